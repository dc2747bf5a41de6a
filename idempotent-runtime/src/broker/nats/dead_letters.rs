//! A JetStream dead-letter subject as an operator reads it, and putting its messages back on the
//! subjects they came from.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer, pull};
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::{self, stream::Stream};
use futures_util::{StreamExt, TryFutureExt};

use super::{ATTEMPTS_HEADER, DEAD_LETTERED_AT_HEADER, REASON_HEADER, SUBJECT_HEADER};
use super::{uncaptured, within};
use crate::broker::dead_letters::{DeadLetter, DeadLetterFilter};
use crate::broker::error::BrokerError;

/// The most messages one listing or redrive reads.
const MOST_READ: usize = 100_000;
/// How many messages one fetch of the listing asks for.
const FETCH: usize = 256;
/// How long one request to JetStream may take.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

/// A JetStream dead-letter subject (the runner's `dead_letters`): its dead letters listed, and put
/// back on the subjects they came from (the `idempotent dlq` command's NATS side).
///
/// A listing reads the subject from the stream that captures it with an ephemeral consumer of its
/// own that acknowledges nothing: the runners' consumers do not notice. A redrive publishes each
/// dead letter it takes to the subject in its [`SUBJECT_HEADER`] with its headers less the
/// runner's `Idempotent-*` (its `Nats-Msg-Id` kept, so the consumer's inbox drops it if it was
/// processed after all), waits for JetStream to store it, and only then deletes the dead letter
/// from its stream: the message starts again at attempt 1, JetStream's delivery count of a new
/// stream message.
///
/// Within the source stream's duplicate window (two minutes by default) JetStream drops a message
/// published again with a `Nats-Msg-Id` it has seen: the redrive stops at the first such dead
/// letter with [`BrokerError::DeadLetterTarget`] and keeps it, so nothing is deleted that was not
/// put back; redrive it after the window. A dead letter whose subject no stream captures stays and
/// stops the redrive the same way. A deletion that fails after the message was stored stops the
/// redrive with the error and leaves the dead letter beside its copy: a second redrive puts it back
/// again, and the inbox drops that copy.
#[derive(Clone)]
pub struct DeadLetterQueue {
    jetstream: jetstream::Context,
    subject: String,
}

impl std::fmt::Debug for DeadLetterQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeadLetterQueue")
            .field("subject", &self.subject)
            .finish_non_exhaustive()
    }
}

impl DeadLetterQueue {
    /// Returns the dead-letter subject `subject` on `jetstream`.
    pub fn new(jetstream: jetstream::Context, subject: impl Into<String>) -> Self {
        Self {
            jetstream,
            subject: subject.into(),
        }
    }

    /// Connects to the server at `url` and returns its dead-letter subject `subject`.
    pub async fn connect(url: &str, subject: impl Into<String>) -> Result<Self, BrokerError> {
        let client = async_nats::connect(url)
            .await
            .map_err(BrokerError::broker)?;
        Ok(Self::new(jetstream::new(client), subject))
    }

    /// Returns the subject's name.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// Returns the dead letters `filter` takes, in the stream's order.
    pub async fn list(&self, filter: &DeadLetterFilter) -> Result<Vec<DeadLetter>, BrokerError> {
        let (_, read) = self.read_all().await?;
        Ok(filter
            .pick(&read, SystemTime::now())
            .map(|(_, letter)| letter.clone())
            .collect())
    }

    /// Puts the dead letters `filter` takes back on the subjects they came from (with `dry_run`,
    /// only says which it would), in the stream's order; returns them. A failure to put one back
    /// stops the redrive there: those before it are back on their subjects, the rest stay.
    pub async fn redrive(
        &self,
        filter: &DeadLetterFilter,
        dry_run: bool,
    ) -> Result<Vec<DeadLetter>, BrokerError> {
        let (stream, read) = self.read_all().await?;
        let mut moved = Vec::new();
        for ((sequence, headers), letter) in filter.pick(&read, SystemTime::now()) {
            let Some(source) = &letter.source else {
                continue;
            };
            if !dry_run {
                self.put_back(headers, letter, source).await?;
                let deleted = stream
                    .delete_message(*sequence)
                    .map_err(BrokerError::broker);
                within("the dead letter's deletion", ANSWER_WITHIN, deleted).await?;
            }
            moved.push(letter.clone());
        }
        Ok(moved)
    }

    /// Publishes `letter` to `source` as it was before it was dead-lettered and waits until
    /// JetStream stored it as a new message.
    async fn put_back(
        &self,
        headers: &HeaderMap,
        letter: &DeadLetter,
        source: &str,
    ) -> Result<(), BrokerError> {
        let mut kept = HeaderMap::new();
        for (name, values) in headers.iter() {
            let name = name.to_string();
            if name.to_ascii_lowercase().starts_with("idempotent-") {
                continue;
            }
            for value in values {
                kept.append(name.as_str(), value.as_str());
            }
        }
        let refused = |reason: String| BrokerError::DeadLetterTarget {
            target: source.to_owned(),
            reason,
        };
        let stored = async {
            self.jetstream
                .publish_with_headers(source.to_owned(), kept, letter.payload.clone().into())
                .await?
                .await
        }
        .map_err(|error| match error.kind() {
            PublishErrorKind::StreamNotFound => refused("no stream captures the subject".into()),
            _ => BrokerError::broker(error),
        });
        let ack = within("the dead letter's publication", ANSWER_WITHIN, stored).await?;
        if ack.duplicate {
            return Err(refused(format!(
                "JetStream dropped it as a duplicate: stream {} stored a message of {} {} within \
                 its duplicate window; put it back after the window",
                ack.stream,
                NATS_MESSAGE_ID,
                letter.message_id.as_deref().unwrap_or("?"),
            )));
        }
        Ok(())
    }

    /// Reads every message of the subject, with the stream that holds them.
    async fn read_all(&self) -> Result<(Stream, Vec<((u64, HeaderMap), DeadLetter)>), BrokerError> {
        let found = self
            .jetstream
            .stream_by_subject(&self.subject)
            .map_err(|error| {
                uncaptured(&self.subject, &error).unwrap_or_else(|| BrokerError::broker(error))
            });
        let name = within("the stream lookup", ANSWER_WITHIN, found).await?;
        let got = self
            .jetstream
            .get_stream(&name)
            .map_err(BrokerError::broker);
        let stream = within("the stream lookup", ANSWER_WITHIN, got).await?;
        let reading = stream
            .create_consumer(pull::Config {
                filter_subject: self.subject.clone(),
                deliver_policy: DeliverPolicy::All,
                ack_policy: AckPolicy::None,
                inactive_threshold: Duration::from_secs(60),
                ..Default::default()
            })
            .map_err(BrokerError::broker);
        let consumer: PullConsumer = within("the reading consumer", ANSWER_WITHIN, reading).await?;
        let reading = consumer.cached_info().name.clone();
        let mut pending = consumer.cached_info().num_pending;
        let mut read = Vec::new();
        while pending > 0 && read.len() < MOST_READ {
            let fetched = consumer
                .fetch()
                .max_messages(FETCH)
                .expires(Duration::from_secs(2))
                .messages()
                .map_err(BrokerError::broker);
            let mut batch = within("a fetch of dead letters", ANSWER_WITHIN, fetched).await?;
            let before = read.len();
            while let Some(message) = batch.next().await {
                let message = message.map_err(BrokerError::Broker)?;
                let info = message.info().map_err(BrokerError::Broker)?;
                let (sequence, left) = (info.stream_sequence, info.pending);
                let headers = message.headers.clone().unwrap_or_default();
                let letter = letter_of(sequence, &headers, &message.payload);
                read.push(((sequence, headers), letter));
                pending = left;
            }
            if read.len() == before {
                break;
            }
        }
        let _ = stream.delete_consumer(&reading).await;
        Ok((stream, read))
    }
}

/// What the runner wrote on the dead letter at `sequence`.
fn letter_of(sequence: u64, headers: &HeaderMap, payload: &[u8]) -> DeadLetter {
    let header = |name: &str| {
        headers
            .get(name)
            .map(|value| value.as_str().to_owned())
            .filter(|value| !value.is_empty())
    };
    let mut all: Vec<(String, String)> = headers
        .iter()
        .flat_map(|(name, values)| {
            values
                .iter()
                .map(move |value| (name.to_string(), value.as_str().to_owned()))
        })
        .collect();
    all.sort();
    DeadLetter {
        id: sequence.to_string(),
        message_id: header(NATS_MESSAGE_ID.as_ref()),
        reason: header(REASON_HEADER),
        attempts: header(ATTEMPTS_HEADER).and_then(|n| n.parse().ok()),
        source: header(SUBJECT_HEADER),
        dead_lettered_at: header(DEAD_LETTERED_AT_HEADER)
            .and_then(|ms| ms.parse().ok())
            .map(|ms| UNIX_EPOCH + Duration::from_millis(ms)),
        headers: all,
        payload: payload.to_vec(),
    }
}
