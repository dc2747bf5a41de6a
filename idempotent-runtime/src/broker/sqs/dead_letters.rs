//! An SQS dead-letter queue as an operator reads it, and putting its messages back where they
//! came from.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{Message, MessageSystemAttributeName};

use super::deletes::MOST_PER_BATCH;
use super::delivery::text_of;
use super::failure::Failure;
use super::queue::Queue;
use super::receive::make_visible;
use super::{ATTEMPTS_ATTRIBUTE, MESSAGE_ID_ATTRIBUTE, QUEUE_ATTRIBUTE, REASON_ATTRIBUTE};
use crate::broker::dead_letters::{DeadLetter, DeadLetterFilter};
use crate::broker::error::BrokerError;

/// How long the messages read stay hidden from other readers while a listing or a redrive runs;
/// those not put back are made visible again at its end.
const HIDDEN_WHILE_READ: Duration = Duration::from_secs(120);

/// How long each request to make messages visible again waits for SQS's answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The most messages one listing or redrive reads.
const MOST_READ: usize = 100_000;

/// An SQS dead-letter queue: its dead letters listed, and put back on the queues they came from
/// (the `idempotent dlq` command's SQS side).
///
/// Reading a queue in SQS is receiving from it: a listing receives every message (hiding each
/// for two minutes, so that none is read twice), then makes them visible again at once. A
/// redrive sends each dead letter it takes to the queue in its [`QUEUE_ATTRIBUTE`] with its body
/// and its attributes (the message id among them; the runner's `idempotent-*` attributes
/// dropped), then deletes it: the message starts again at attempt 1 (SQS's receive count is the
/// new message's), and the consumer's inbox drops it if it was processed after all. A dead letter
/// without a source queue (one SQS moved itself) is not taken by a redrive; the others are made
/// visible again.
#[derive(Debug, Clone)]
pub struct DeadLetterQueue {
    client: Client,
    url: String,
}

impl DeadLetterQueue {
    /// Returns the dead-letter queue at `url`.
    pub fn new(client: Client, url: impl Into<String>) -> Self {
        Self {
            client,
            url: url.into(),
        }
    }

    /// Returns the dead-letter queue of the queue at `queue_url`: the one its redrive policy names.
    pub async fn of_queue(client: Client, queue_url: &str) -> Result<Self, BrokerError> {
        let never = tokio_util::sync::CancellationToken::new();
        let queue = Queue::find(&client, queue_url, 1, &never)
            .await?
            .expect("never shut down");
        Ok(Self::new(client, queue.dead_letters))
    }

    /// Returns the queue's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Returns the dead letters `filter` takes, oldest first.
    pub async fn list(&self, filter: &DeadLetterFilter) -> Result<Vec<DeadLetter>, BrokerError> {
        let read = self.read_all().await?;
        let now = SystemTime::now();
        let letters = filter
            .pick(&read, now)
            .map(|(_, letter)| letter.clone())
            .collect();
        make_visible(
            &self.client,
            &self.url,
            read.iter().map(|(message, _)| message),
            REQUEST_TIMEOUT,
        )
        .await;
        Ok(letters)
    }

    /// Puts the dead letters `filter` takes back on the queues they came from (with `dry_run`,
    /// only says which it would), oldest first; returns them. A failure to send one stops the
    /// redrive there: those before it are back on their queues, the rest stay dead letters.
    pub async fn redrive(
        &self,
        filter: &DeadLetterFilter,
        dry_run: bool,
    ) -> Result<Vec<DeadLetter>, BrokerError> {
        let read = self.read_all().await?;
        let now = SystemTime::now();
        let mut moved = Vec::new();
        let mut failed = None;
        for (message, letter) in filter.pick(&read, now) {
            let Some(source) = &letter.source else {
                continue;
            };
            if !dry_run && let Err(error) = self.put_back(message, letter, source).await {
                failed = Some(error);
                break;
            }
            moved.push(letter.clone());
        }
        let left = read
            .iter()
            .filter(|(_, letter)| dry_run || !moved.iter().any(|done| done.id == letter.id));
        make_visible(
            &self.client,
            &self.url,
            left.map(|(message, _)| message),
            REQUEST_TIMEOUT,
        )
        .await;
        match failed {
            Some(error) => Err(error),
            None => Ok(moved),
        }
    }

    /// Sends `message` to `source` as it was before it was dead-lettered, then deletes it here.
    async fn put_back(
        &self,
        message: &Message,
        letter: &DeadLetter,
        source: &str,
    ) -> Result<(), BrokerError> {
        let mut send = self
            .client
            .send_message()
            .queue_url(source)
            .message_body(message.body().unwrap_or_default());
        for (name, value) in message.message_attributes().into_iter().flatten() {
            if !name.starts_with("idempotent-") {
                send = send.message_attributes(name, value.clone());
            }
        }
        if source.ends_with(".fifo") {
            let group = message
                .attributes()
                .and_then(|all| all.get(&MessageSystemAttributeName::MessageGroupId))
                .map(String::as_str)
                .or(letter.message_id.as_deref())
                .unwrap_or("idempotent-redriven");
            // A deduplication id of its own: the message's first one would be dropped within SQS's
            // five minutes.
            send = send
                .message_group_id(group)
                .message_deduplication_id(format!("redriven-{}", letter.id));
        }
        send.send()
            .await
            .map_err(|error| BrokerError::broker(Failure::of(&error, source)))?;
        self.client
            .delete_message()
            .queue_url(&self.url)
            .receipt_handle(message.receipt_handle().unwrap_or_default())
            .send()
            .await
            .map_err(|error| BrokerError::broker(Failure::of(&error, &self.url)))?;
        Ok(())
    }

    /// Receives every message of the queue, hiding each while the caller works; oldest first.
    async fn read_all(&self) -> Result<Vec<(Message, DeadLetter)>, BrokerError> {
        let mut read: Vec<(Message, DeadLetter)> = Vec::new();
        while read.len() < MOST_READ {
            let received = self
                .client
                .receive_message()
                .queue_url(&self.url)
                .max_number_of_messages(MOST_PER_BATCH as i32)
                .wait_time_seconds(1)
                .visibility_timeout(HIDDEN_WHILE_READ.as_secs() as i32)
                .message_attribute_names("All")
                .message_system_attribute_names(MessageSystemAttributeName::SentTimestamp)
                .message_system_attribute_names(MessageSystemAttributeName::MessageGroupId)
                .send()
                .await;
            let messages = match received {
                Ok(answer) => answer.messages.unwrap_or_default(),
                Err(error) => {
                    let error = BrokerError::broker(Failure::of(&error, &self.url));
                    make_visible(
                        &self.client,
                        &self.url,
                        read.iter().map(|(message, _)| message),
                        REQUEST_TIMEOUT,
                    )
                    .await;
                    return Err(error);
                }
            };
            if messages.is_empty() {
                break;
            }
            read.extend(messages.into_iter().map(|message| {
                let letter = letter_of(&message);
                (message, letter)
            }));
        }
        read.sort_by_key(|(_, letter)| letter.dead_lettered_at);
        Ok(read)
    }
}

/// What the runner wrote on `message`, a dead letter.
fn letter_of(message: &Message) -> DeadLetter {
    let mut headers: Vec<(String, String)> = message
        .message_attributes()
        .into_iter()
        .flatten()
        .filter_map(|(name, value)| Some((name.clone(), text_of(value)?.to_owned())))
        .collect();
    headers.sort();
    let header = |name: &str| {
        headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.clone())
    };
    let dead_lettered_at = message
        .attributes()
        .and_then(|all| all.get(&MessageSystemAttributeName::SentTimestamp))
        .and_then(|ms| ms.parse::<u64>().ok())
        .map(|ms| UNIX_EPOCH + Duration::from_millis(ms));
    DeadLetter {
        id: message.message_id().unwrap_or_default().to_owned(),
        message_id: header(MESSAGE_ID_ATTRIBUTE),
        reason: header(REASON_ATTRIBUTE),
        attempts: header(ATTEMPTS_ATTRIBUTE).and_then(|n| n.parse().ok()),
        source: header(QUEUE_ATTRIBUTE),
        dead_lettered_at,
        payload: message.body().unwrap_or_default().as_bytes().to_vec(),
        headers,
    }
}
