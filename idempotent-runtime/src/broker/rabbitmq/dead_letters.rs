//! A RabbitMQ dead-letter queue as an operator reads it, and putting its messages back on the
//! queues they came from.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicGetOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};

use super::confirms::ConfirmChannels;
use super::delivery::{integer, text};
use super::headers::{ATTEMPTS_HEADER, DEAD_LETTERED_AT_HEADER, QUEUE_HEADER, REASON_HEADER};
use crate::broker::dead_letters::{DeadLetter, DeadLetterFilter};
use crate::broker::error::BrokerError;

/// The most messages one listing or redrive reads.
const MOST_READ: usize = 100_000;

/// A RabbitMQ dead-letter queue (the runner's `<queue>.dead`): its dead letters listed, and put
/// back on the queues they came from (the `idempotent dlq` command's RabbitMQ side).
///
/// A listing takes every message of the queue with `basic.get` on a channel of its own, without
/// acknowledging them (other consumers of the queue do not see them meanwhile), then closes the
/// channel, which gives them all back in their order. A redrive publishes each dead letter it takes
/// to the queue in its [`QUEUE_HEADER`], persistent and confirmed, with its properties (its
/// `message_id` among them) and its headers less the runner's `x-idempotent-*`, and acknowledges it
/// here only then: the message starts again at attempt 1, and the consumer's inbox drops it if it
/// was processed after all. A dead letter whose queue no longer exists stays (the publication comes
/// back unroutable) and stops the redrive.
#[derive(Clone)]
pub struct DeadLetterQueue {
    connection: Arc<Connection>,
    queue: String,
}

impl std::fmt::Debug for DeadLetterQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeadLetterQueue")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

impl DeadLetterQueue {
    /// Returns the dead-letter queue `queue` on `connection`.
    pub fn new(connection: Connection, queue: impl Into<String>) -> Self {
        Self {
            connection: Arc::new(connection),
            queue: queue.into(),
        }
    }

    /// Connects to the broker at `url` and returns its dead-letter queue `queue`.
    pub async fn connect(url: &str, queue: impl Into<String>) -> Result<Self, BrokerError> {
        let connection = Connection::connect(url, ConnectionProperties::default())
            .await
            .map_err(BrokerError::broker)?;
        Ok(Self::new(connection, queue))
    }

    /// Returns the queue's name.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// Returns the dead letters `filter` takes, in the queue's order.
    pub async fn list(&self, filter: &DeadLetterFilter) -> Result<Vec<DeadLetter>, BrokerError> {
        let (channel, read) = self.read_all().await?;
        let now = SystemTime::now();
        let letters = filter
            .pick(&read, now)
            .map(|(_, letter)| letter.clone())
            .collect();
        give_back(channel).await;
        Ok(letters)
    }

    /// Puts the dead letters `filter` takes back on the queues they came from (with `dry_run`,
    /// only says which it would), in the queue's order; returns them. A failure to publish one
    /// stops the redrive there: those before it are back on their queues, the rest stay.
    pub async fn redrive(
        &self,
        filter: &DeadLetterFilter,
        dry_run: bool,
    ) -> Result<Vec<DeadLetter>, BrokerError> {
        let (channel, read) = self.read_all().await?;
        let now = SystemTime::now();
        let publishing = ConfirmChannels::on(self.connection.clone());
        let mut moved = Vec::new();
        let mut failed = None;
        for (delivery, letter) in filter.pick(&read, now) {
            let Some(source) = &letter.source else {
                continue;
            };
            if !dry_run && let Err(error) = put_back(&publishing, delivery, source).await {
                failed = Some(error);
                break;
            }
            moved.push(letter.clone());
        }
        give_back(channel).await;
        match failed {
            Some(error) => Err(error),
            None => Ok(moved),
        }
    }

    /// Takes every message of the queue, unacknowledged, on a channel of its own.
    async fn read_all(&self) -> Result<(Channel, Vec<(Delivery, DeadLetter)>), BrokerError> {
        let channel = self
            .connection
            .create_channel()
            .await
            .map_err(BrokerError::broker)?;
        let mut read = Vec::new();
        while read.len() < MOST_READ {
            let got = channel
                .basic_get(
                    self.queue.as_str().into(),
                    BasicGetOptions { no_ack: false },
                )
                .await;
            match got {
                Ok(Some(got)) => {
                    let letter = letter_of(&got.delivery);
                    read.push((got.delivery, letter));
                }
                Ok(None) => break,
                Err(error) => {
                    give_back(channel).await;
                    return Err(BrokerError::broker(error));
                }
            }
        }
        Ok((channel, read))
    }
}

/// Closes the reading channel: what it took and did not acknowledge goes back to the queue.
async fn give_back(channel: Channel) {
    let _ = channel.close(200, "done reading".into()).await;
}

/// Publishes `delivery`'s message to `source` as it was before it was dead-lettered, confirmed,
/// then acknowledges it here.
async fn put_back(
    publishing: &Arc<ConfirmChannels>,
    delivery: &Delivery,
    source: &str,
) -> Result<(), BrokerError> {
    let properties = &delivery.properties;
    let mut kept = FieldTable::default();
    for (name, value) in properties.headers().iter().flat_map(|table| table.inner()) {
        if !name.as_str().starts_with("x-idempotent-") {
            kept.insert(name.clone(), value.clone());
        }
    }
    let properties: BasicProperties = properties.clone().with_headers(kept).with_delivery_mode(2);
    let confirmation = publishing
        .lend()
        .await
        .map_err(BrokerError::broker)?
        .publish("".into(), source.into(), &delivery.data, properties)
        .await
        .map_err(BrokerError::broker)?;
    match confirmation {
        Confirmation::Ack(None) => {}
        Confirmation::Ack(Some(_)) => {
            return Err(BrokerError::DeadLetterTarget {
                target: source.to_owned(),
                reason: "no such queue: the message came back unroutable".into(),
            });
        }
        _ => return Err(BrokerError::Refused { what: "redrive" }),
    }
    delivery
        .ack(BasicAckOptions::default())
        .await
        .map(drop)
        .map_err(BrokerError::broker)
}

/// What the runner wrote on `delivery`, a dead letter.
fn letter_of(delivery: &Delivery) -> DeadLetter {
    let properties = &delivery.properties;
    let table = properties.headers().clone().unwrap_or_default();
    let header = |name: &str| table.inner().get(name);
    let mut headers: Vec<(String, String)> = table
        .inner()
        .iter()
        .filter_map(|(name, value)| Some((name.as_str().to_owned(), text(value)?)))
        .collect();
    headers.sort();
    let at_ms = header(DEAD_LETTERED_AT_HEADER).and_then(|value| match value {
        AMQPValue::LongLongInt(ms) => u64::try_from(*ms).ok(),
        other => integer(other).map(u64::from),
    });
    let dead_lettered_at = at_ms
        .map(Duration::from_millis)
        .or_else(|| properties.timestamp().map(Duration::from_secs))
        .map(|since| UNIX_EPOCH + since);
    DeadLetter {
        id: delivery.delivery_tag.to_string(),
        message_id: properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_owned())
            .filter(|id| !id.is_empty()),
        reason: header(REASON_HEADER).and_then(text),
        attempts: header(ATTEMPTS_HEADER).and_then(integer),
        source: header(QUEUE_HEADER).and_then(text),
        dead_lettered_at,
        headers,
        payload: delivery.data.clone(),
    }
}
