//! One RabbitMQ delivery, and how it is settled: acknowledged, or republished to a delay queue or
//! the dead-letter queue and then acknowledged.

use std::sync::Arc;
use std::time::Duration;

use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Confirmation};

use super::confirms::ConfirmChannels;
use super::delay_queues::is_retry_queue;
use super::headers::{
    ATTEMPT_HEADER, ATTEMPTS_HEADER, DEAD_LETTERED_AT_HEADER, QUEUE_HEADER, REASON_HEADER,
};
use crate::broker::delivery::Delivery;
use crate::broker::error::BrokerError;
use crate::broker::message::{Message, MessageId, Redelivered};
use crate::broker::route::Route;
use crate::markers::DeliveryTag;

/// What a runner sets up on each connection, and what its deliveries need to settle.
pub(super) struct RunnerSetup {
    pub(super) queue: String,
    pub(super) retry_queues: Vec<(Duration, String)>,
    pub(super) dead_letters: String,
    pub(super) consumer_tag: String,
    pub(super) prefetch: u16,
    pub(super) publish_timeout: Duration,
}

/// What every delivery of one session needs to settle.
pub(super) struct SessionContext {
    /// Where copies to the delay and dead-letter queues are published, each on a channel of its
    /// own until confirmed: a copy returned unroutable is then known to be that copy.
    pub(super) publishing: Arc<ConfirmChannels>,
    pub(super) setup: Arc<RunnerSetup>,
}

/// A delivery from RabbitMQ, with what its session needs to settle it.
pub(super) struct AmqpDelivery {
    pub(super) delivery: lapin::message::Delivery,
    pub(super) context: Arc<SessionContext>,
}

/// The headers RabbitMQ writes when it dead-letters a message (here: when a retry expires in a
/// delay queue); a dead letter goes without them, so that it starts again when moved back.
const DEATH_HEADERS: [&str; 7] = [
    "x-death",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-first-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
    "x-last-death-exchange",
];

impl AmqpDelivery {
    /// Publishes a copy of the message to `queue` (mandatory: an unroutable copy is an error) with
    /// `headers` added and `remove` removed, persistent, and waits at most the publish timeout for
    /// the broker's confirmation.
    async fn republish(
        &self,
        queue: &str,
        headers: Vec<(&str, AMQPValue)>,
        remove: &[&str],
        what: &'static str,
    ) -> Result<(), BrokerError> {
        let properties = &self.delivery.properties;
        let mut table = properties.headers().clone().unwrap_or_default();
        if !remove.is_empty() {
            let mut kept = FieldTable::default();
            for (name, value) in table.inner() {
                if !remove.contains(&name.as_str()) {
                    kept.insert(name.clone(), value.clone());
                }
            }
            table = kept;
        }
        for (name, value) in headers {
            table.insert(name.into(), value);
        }
        let properties: BasicProperties =
            properties.clone().with_headers(table).with_delivery_mode(2);
        let publish = async {
            self.context
                .publishing
                .lend()
                .await
                .map_err(BrokerError::broker)?
                .publish("".into(), queue.into(), &self.delivery.data, properties)
                .await
                .map_err(BrokerError::broker)
        };
        let after = self.context.setup.publish_timeout;
        match tokio::time::timeout(after, publish).await {
            Err(_) => Err(BrokerError::Timeout { what, after }),
            Ok(Err(error)) => Err(error),
            Ok(Ok(Confirmation::Ack(None))) => Ok(()),
            Ok(Ok(_)) => Err(BrokerError::Refused { what }),
        }
    }

    /// Acknowledges the delivery, waiting at most the publish timeout: a blocked connection (a
    /// memory alarm) holds every frame back, acknowledgements too.
    async fn ack(&self) -> Result<(), BrokerError> {
        let after = self.context.setup.publish_timeout;
        match tokio::time::timeout(after, self.delivery.ack(BasicAckOptions::default())).await {
            Err(_) => Err(BrokerError::Timeout {
                what: "acknowledgement",
                after,
            }),
            Ok(acked) => acked.map(drop).map_err(BrokerError::broker),
        }
    }

    /// The attempt this delivery is: 1 plus the times it expired in one of this runner's delay
    /// queues, as RabbitMQ's `x-death` entries say.
    fn attempt(&self) -> u32 {
        let queue = self.context.setup.queue.as_str();
        let Some(AMQPValue::FieldArray(deaths)) = self
            .delivery
            .properties
            .headers()
            .as_ref()
            .and_then(|table| table.inner().get("x-death"))
        else {
            return 1;
        };
        let mut retries: u32 = 0;
        for death in deaths.as_slice() {
            let AMQPValue::FieldTable(death) = death else {
                continue;
            };
            let field = |name: &str| death.inner().get(name);
            let from_delay_queue = field("queue")
                .and_then(bytes)
                .is_some_and(|name| is_retry_queue(queue, name));
            let expired = field("reason").and_then(bytes) == Some(b"expired".as_slice());
            if from_delay_queue && expired {
                let count = field("count").and_then(integer).unwrap_or(1);
                retries = retries.saturating_add(count);
            }
        }
        retries.saturating_add(1)
    }
}

impl Delivery for AmqpDelivery {
    const RELEASE_DELAYS: bool = false;

    fn message(&self) -> Result<Message, String> {
        let properties = &self.delivery.properties;
        let message_id = properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_owned())
            .filter(|id| !id.is_empty())
            .ok_or_else(|| "the message has no message_id property: it has no key".to_owned())?;
        let mut headers = Vec::new();
        if let Some(table) = properties.headers() {
            for (name, value) in table.inner() {
                if let Some(text) = text(value) {
                    headers.push((name.as_str().to_owned(), text));
                }
            }
        }
        Ok(Message {
            message_id: MessageId(message_id),
            payload: self.delivery.data.clone(),
            headers,
            attempt: self.attempt(),
            delivery_tag: DeliveryTag(self.delivery.delivery_tag),
            redelivered: Redelivered(self.delivery.redelivered),
            stream_sequence: None,
        })
    }

    async fn settle(&self, route: &Route) -> Result<(), BrokerError> {
        match route {
            Route::Ack => return self.ack().await,
            Route::Retry { attempt, after } => {
                let retry_queues = &self.context.setup.retry_queues;
                // The longest delay queue not longer than the delay (the policy's delays each
                // have theirs; past the hundredth, the longest).
                let queue = retry_queues
                    .iter()
                    .rev()
                    .find(|(delay, _)| delay <= after)
                    .or(retry_queues.first())
                    .map(|(_, queue)| queue.clone())
                    .ok_or(BrokerError::Refused { what: "retry" })?;
                let attempt = AMQPValue::LongLongInt(i64::from(*attempt));
                self.republish(&queue, vec![(ATTEMPT_HEADER, attempt)], &[], "retry")
                    .await?;
            }
            Route::DeadLetter { reason, attempts } => {
                let headers = vec![
                    (
                        REASON_HEADER,
                        AMQPValue::LongString(LongString::from(reason.as_str())),
                    ),
                    (
                        ATTEMPTS_HEADER,
                        AMQPValue::LongLongInt(i64::from(*attempts)),
                    ),
                    (
                        QUEUE_HEADER,
                        AMQPValue::LongString(self.context.setup.queue.as_str().into()),
                    ),
                    (DEAD_LETTERED_AT_HEADER, AMQPValue::LongLongInt(now_ms())),
                ];
                let mut remove = DEATH_HEADERS.to_vec();
                remove.push(ATTEMPT_HEADER);
                let queue = &self.context.setup.dead_letters;
                self.republish(queue, headers, &remove, "dead letter")
                    .await?;
            }
        }
        self.ack().await
    }

    async fn release(self, _after: Duration) {
        // Not waited for past the publish timeout (a blocked connection): a delivery left
        // unacknowledged is delivered again all the same once its channel closes.
        let nack = self.delivery.nack(BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        });
        let _ = tokio::time::timeout(self.context.setup.publish_timeout, nack).await;
    }
}

fn bytes(value: &AMQPValue) -> Option<&[u8]> {
    match value {
        AMQPValue::LongString(s) => Some(s.as_bytes()),
        AMQPValue::ShortString(s) => Some(s.as_str().as_bytes()),
        _ => None,
    }
}

pub(super) fn integer(value: &AMQPValue) -> Option<u32> {
    let n = match value {
        AMQPValue::ShortShortUInt(n) => i64::from(*n),
        AMQPValue::ShortUInt(n) => i64::from(*n),
        AMQPValue::LongUInt(n) => i64::from(*n),
        AMQPValue::ShortShortInt(n) => i64::from(*n),
        AMQPValue::ShortInt(n) => i64::from(*n),
        AMQPValue::LongInt(n) => i64::from(*n),
        AMQPValue::LongLongInt(n) => *n,
        _ => return None,
    };
    u32::try_from(n).ok()
}

pub(super) fn text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        other => integer(other).map(|n| n.to_string()),
    }
}

/// Now, in milliseconds since the Unix epoch.
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            i64::try_from(since.as_millis()).unwrap_or(i64::MAX)
        })
}
