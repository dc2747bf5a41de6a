//! Publishing the outbox's messages to SQS queues, each `Ok` once SQS answered that it has it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use aws_sdk_sqs::Client;

use super::MESSAGE_ID_ATTRIBUTE;
use super::delivery::text_attribute;
use super::failure::Failure;
use crate::broker::options::DEFAULT_PUBLISH_TIMEOUT;
use crate::outbox::{Publication, PublishError, Publisher};

/// The most message attributes SQS keeps on a message: the message id and nine headers.
const MOST_ATTRIBUTES: usize = 10;

/// The longest message group or deduplication id SQS takes.
const LONGEST_FIFO_ID: usize = 128;

/// Publishes a relay's outgoing messages to SQS (an [`outbox`](crate::outbox) [`Publisher`]): to
/// the queue the destination names ([`Destination::queue`], with the queue's URL or its name,
/// which is looked up once), with the message's id in the [`MESSAGE_ID_ATTRIBUTE`] attribute,
/// where the SQS runner reads its key, and its headers as `String` attributes. `Ok` means SQS
/// answered `SendMessage` with the message's id: it has it.
///
/// To a FIFO queue (a name ending in `.fifo`) the message goes with its ordering key as the message
/// group (its id where it has none) and its id as the deduplication id (hashed with SHA-256 where
/// either is longer than SQS takes), so SQS drops a second publication within its five minutes.
/// A standard queue keeps no order: give messages whose order matters an ordering key and a FIFO
/// queue.
///
/// | SQS | the relay |
/// |---|---|
/// | answers with the message's id | marks the row sent |
/// | no such queue, too large, contents or attributes it refuses, more than nine headers, a header named `message-id`, a payload that is not UTF-8 (SQS bodies are text), a destination with an exchange | [`PublishError::Rejected`]: an attempt; parked after the last |
/// | no answer within the timeout, throttling, its own errors, no connection | [`PublishError::Unavailable`]: left pending |
///
/// [`Destination::queue`]: crate::outbox::Destination::queue
#[derive(Debug)]
pub struct OutboxPublisher {
    client: Client,
    timeout: Duration,
    /// The URLs of the queues named by name, as SQS answered them.
    urls: Mutex<HashMap<String, String>>,
}

impl OutboxPublisher {
    /// Creates a publisher on `client` that waits at most
    /// [`DEFAULT_PUBLISH_TIMEOUT`](crate::broker::DEFAULT_PUBLISH_TIMEOUT) (10 s) for SQS's answer.
    pub fn new(client: Client) -> Self {
        Self {
            client,
            timeout: DEFAULT_PUBLISH_TIMEOUT,
            urls: Mutex::default(),
        }
    }

    /// Returns the same publisher, waiting at most `timeout` for SQS's answer.
    pub fn with_timeout(self, timeout: Duration) -> Self {
        Self { timeout, ..self }
    }

    /// The URL of the queue `queue` names: itself when it is a URL, else SQS's answer for the name.
    async fn url(&self, queue: &str) -> Result<String, PublishError> {
        if queue.contains("://") {
            return Ok(queue.to_owned());
        }
        if let Some(url) = self.known(queue) {
            return Ok(url);
        }
        let found = self.client.get_queue_url().queue_name(queue).send().await;
        let url = match found {
            Ok(found) => found.queue_url().unwrap_or_default().to_owned(),
            Err(error) => return Err(publish_error(Failure::of(&error, queue))),
        };
        self.urls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(queue.to_owned(), url.clone());
        Ok(url)
    }

    fn known(&self, queue: &str) -> Option<String> {
        let urls = self.urls.lock().unwrap_or_else(|e| e.into_inner());
        urls.get(queue).cloned()
    }
}

impl Publisher for OutboxPublisher {
    async fn publish(&self, publication: &Publication) -> Result<(), PublishError> {
        let destination = &publication.destination;
        if !destination.exchange.is_empty() {
            return Err(PublishError::rejected(format!(
                "SQS has no exchanges (this message is for exchange {:?}): send it to a queue",
                destination.exchange
            )));
        }
        let Ok(body) = std::str::from_utf8(&publication.payload) else {
            return Err(PublishError::rejected(
                "SQS message bodies are text and this payload is not UTF-8: encode it (base64, \
                 say) before queueing it",
            ));
        };
        if publication.headers.len() >= MOST_ATTRIBUTES {
            return Err(PublishError::rejected(format!(
                "SQS keeps at most {MOST_ATTRIBUTES} attributes on a message, and this one has {} \
                 headers besides its message id",
                publication.headers.len()
            )));
        }
        if let Some((name, _)) = publication
            .headers
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(MESSAGE_ID_ATTRIBUTE))
        {
            return Err(PublishError::rejected(format!(
                "a header named {name:?} would stand in for the message's id, the consumer's key"
            )));
        }
        let answer = async {
            let url = self.url(&destination.routing_key).await?;
            let mut send = self
                .client
                .send_message()
                .queue_url(&url)
                .message_body(body)
                .message_attributes(
                    MESSAGE_ID_ATTRIBUTE,
                    text_attribute(&publication.message_id),
                );
            for (name, value) in &publication.headers {
                send = send.message_attributes(name, text_attribute(value));
            }
            if url.ends_with(".fifo") {
                let group = publication
                    .ordering_key
                    .as_deref()
                    .unwrap_or(&publication.message_id);
                send = send
                    .message_group_id(fifo_id(group))
                    .message_deduplication_id(fifo_id(&publication.message_id));
            }
            send.send()
                .await
                .map_err(|error| publish_error(Failure::of(&error, &url)))
        };
        match tokio::time::timeout(self.timeout, answer).await {
            Err(elapsed) => Err(PublishError::unavailable(elapsed)),
            Ok(Err(error)) => Err(error),
            Ok(Ok(_)) => Ok(()),
        }
    }
}

/// What a failure of SQS's means for the relay.
fn publish_error(failure: Failure) -> PublishError {
    match failure {
        Failure::Unavailable(_) => PublishError::unavailable(failure),
        Failure::NoQueue(reason) | Failure::Refused(reason) => PublishError::rejected(reason),
    }
}

/// `id` as a FIFO queue takes it (at most 128 printable ASCII characters), else its SHA-256 in hex.
fn fifo_id(id: &str) -> String {
    use sha2::Digest;
    if id.len() <= LONGEST_FIFO_ID && id.bytes().all(|b| b.is_ascii_graphic()) {
        id.to_owned()
    } else {
        let digest = sha2::Sha256::digest(id.as_bytes());
        digest.iter().map(|byte| format!("{byte:02x}")).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::fifo_id;

    #[test]
    fn fifo_ids_are_kept_when_sqs_takes_them_and_hashed_otherwise() {
        assert_eq!(fifo_id("order-7"), "order-7");
        let long = "x".repeat(129);
        assert_eq!(fifo_id(&long).len(), 64);
        assert_eq!(fifo_id("with space"), fifo_id("with space"));
        assert_ne!(fifo_id("with space"), "with space");
        assert_eq!(fifo_id(&"y".repeat(128)), "y".repeat(128));
    }
}
