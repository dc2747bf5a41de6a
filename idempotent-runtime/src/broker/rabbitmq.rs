//! The runner for RabbitMQ (AMQP 0-9-1, with `lapin`).
//!
//! ```no_run
//! # use idempotent_runtime as idempotent;
//! use idempotent::broker::rabbitmq::Runner;
//! use idempotent::broker::{Message, RetryPolicy, Shutdown};
//! # async fn demo(channel: lapin::Channel, inbox: idempotent::Inbox<sqlx::Sqlite>, shutdown: Shutdown) -> Result<(), Box<dyn std::error::Error>> {
//! let stats = Runner::new(channel, "payments")
//!     .workers(4)
//!     .retry(RetryPolicy::new(5, std::time::Duration::from_secs(1)))
//!     .shutdown_on(shutdown)
//!     .run(|| {
//!         let inbox = inbox.for_worker();
//!         move |message: Message| {
//!             let inbox = inbox.clone();
//!             async move {
//!                 // decode `message.payload`, then call an #[idempotent] handler keyed on
//!                 // `message.message_id` with `&inbox`
//!                 # let _ = (inbox, message);
//!                 # Ok::<_, idempotent::Error<std::convert::Infallible>>(idempotent::Handled::Processed(()))
//!             }
//!         }
//!     })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! The key is the producer's `message_id` property; a delivery without one is dead-lettered.
//!
//! **Retries** go through delay queues: a delivery to try again after `d` is published, with the
//! next attempt's number in the `x-idempotent-attempt` header, to the queue `<queue>.retry.<d>ms`,
//! whose messages expire after `d` and are dead-lettered back to `<queue>` by RabbitMQ; once the
//! broker confirmed that publish, the delivery is acknowledged. One queue per delay, so that no
//! message waits behind a longer one. Crash redeliveries (no outcome was reached) are not counted
//! as attempts.
//!
//! **Dead letters** are published to `<queue>.dead` (or the queue you name) with the headers
//! `x-idempotent-reason`, `x-idempotent-attempts` and `x-idempotent-queue`, and acknowledged once
//! the broker confirmed them. The runner declares these queues (durable) when it starts, and puts
//! its channel in publisher-confirm mode.
//!
//! At most `workers` deliveries are unacknowledged at once (`basic.qos`). On shutdown the runner
//! cancels its consumer, settles the deliveries in flight, and returns to the broker (`nack` with
//! requeue) those it had received but not started.

/// The AMQP client this runner was built against: make the runner's channel with it.
pub use lapin;

mod publisher;
pub use publisher::OutboxPublisher;

use std::collections::BTreeSet;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation};

use super::{
    BatchBody, Batches, BeforeSettle, BrokerError, Delivery, Message, MessageId, Options,
    Redelivered, RetryPolicy, Route, RunnerStats, Shutdown, Take, drive,
};
use crate::error::Error;
use crate::inbox::{Handled, Inbox};
use crate::markers::DeliveryTag;
use crate::store::Backend;

/// The header that carries a retried delivery's attempt number.
pub const ATTEMPT_HEADER: &str = "x-idempotent-attempt";
/// The header that carries a dead letter's reason.
pub const REASON_HEADER: &str = "x-idempotent-reason";
/// The header that carries the number of attempts a dead letter had.
pub const ATTEMPTS_HEADER: &str = "x-idempotent-attempts";
/// The header that names the queue a dead letter came from.
pub const QUEUE_HEADER: &str = "x-idempotent-queue";

/// Consumes one queue and settles each delivery by its handler's outcome; see the
/// [module docs](self).
pub struct Runner {
    channel: Channel,
    queue: String,
    dead_letter_queue: Option<String>,
    consumer_tag: String,
    options: Options,
}

impl fmt::Debug for Runner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runner")
            .field("queue", &self.queue)
            .field("workers", &self.options.workers)
            .field("retry", &self.options.retry)
            .finish_non_exhaustive()
    }
}

impl Runner {
    /// A runner consuming `queue` on `channel`, with one worker, the default [`RetryPolicy`] and
    /// dead letters to `<queue>.dead`. The queue must exist.
    pub fn new(channel: Channel, queue: impl Into<String>) -> Self {
        Self {
            channel,
            queue: queue.into(),
            dead_letter_queue: None,
            consumer_tag: String::new(),
            options: Options::default(),
        }
    }

    /// Runs `workers` handlers at once (and lets as many deliveries be unacknowledged).
    pub fn workers(mut self, workers: usize) -> Self {
        self.options.workers = workers.max(1);
        self
    }

    /// Retries retryable failures by `policy`.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.options.retry = policy;
        self
    }

    /// Dead-letters to `queue` instead of `<queue>.dead`.
    pub fn dead_letter_queue(self, queue: impl Into<String>) -> Self {
        Self {
            dead_letter_queue: Some(queue.into()),
            ..self
        }
    }

    /// Stops gracefully when `shutdown` is cancelled.
    pub fn shutdown_on(mut self, shutdown: Shutdown) -> Self {
        self.options.shutdown = shutdown;
        self
    }

    /// Calls `hook` with each delivery's message and route once its outcome is known, before the
    /// runner settles it (for logging, auditing or tests); the delivery is settled when the hook's
    /// future completes. Deliveries dead-lettered for lack of a message id are not shown to it.
    pub fn before_settle(mut self, hook: BeforeSettle) -> Self {
        self.options.before_settle = Some(hook);
        self
    }

    /// What the runner counted so far; the same counters [`run`](Self::run) returns at the end.
    pub fn stats(&self) -> impl Fn() -> RunnerStats + Send + Sync + 'static {
        self.options.stats()
    }

    /// The queue dead letters go to.
    pub fn dead_letters(&self) -> String {
        self.dead_letter_queue
            .clone()
            .unwrap_or_else(|| format!("{}.dead", self.queue))
    }

    /// The delay queue of retries after `delay`.
    fn retry_queue(&self, delay: Duration) -> String {
        format!("{}.retry.{}ms", self.queue, delay.as_millis())
    }

    /// Consumes until the queue's consumer ends or the shutdown token is cancelled, with a handler
    /// from `new_worker` per worker. Returns what it counted.
    pub async fn run<F, W, Fut, T, E>(self, new_worker: F) -> Result<RunnerStats, BrokerError>
    where
        F: FnMut() -> W,
        W: FnMut(Message) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Handled<T>, Error<E>>> + Send,
        T: Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let (workers, take, process) = self.options.one_at_a_time(new_worker);
        self.consume(workers, take, process).await
    }

    /// Consumes as [`run`](Self::run) does, handling the deliveries in batches: a worker takes up
    /// to `batches.size` deliveries, runs `body` for each new message in one transaction on its
    /// worker's inbox (each in a savepoint, as
    /// [`Inbox::handle_batch_each`](crate::Inbox::handle_batch_each) does), commits once, then
    /// settles each delivery by its own outcome: the good ones and the duplicates are
    /// acknowledged, a failing one retried or dead-lettered alone.
    pub async fn run_batches<DB, F, B, T, E>(
        self,
        inbox: Inbox<DB>,
        consumer: impl Into<String>,
        batches: Batches,
        new_body: F,
    ) -> Result<RunnerStats, BrokerError>
    where
        DB: Backend,
        F: FnMut() -> B,
        B: BatchBody<DB, T, E>,
        T: Send + 'static,
        E: std::error::Error + Send + 'static,
    {
        let (workers, take, process) =
            self.options
                .in_batches(&inbox, consumer.into(), batches, new_body);
        self.consume(workers, take, process).await
    }

    /// Declares the runner's queues, consumes, and drives the workers.
    async fn consume<W, P, PF>(
        self,
        workers: Vec<W>,
        take: Take,
        process: P,
    ) -> Result<RunnerStats, BrokerError>
    where
        W: Send + 'static,
        P: FnMut(W, Vec<AmqpDelivery>) -> PF,
        PF: Future<Output = (W, Result<(), BrokerError>)> + Send + 'static,
    {
        let channel = &self.channel;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(BrokerError::broker)?;
        let prefetch = (self.options.workers * take.most).min(u16::MAX as usize) as u16;
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(BrokerError::broker)?;
        let delays: BTreeSet<Duration> = (1..self.options.retry.max_attempts)
            .map(|attempt| self.options.retry.delay_after(attempt))
            .collect();
        for delay in &delays {
            let mut arguments = FieldTable::default();
            arguments.insert(
                "x-message-ttl".into(),
                AMQPValue::LongLongInt(delay.as_millis() as i64),
            );
            arguments.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString("".into()),
            );
            arguments.insert(
                "x-dead-letter-routing-key".into(),
                AMQPValue::LongString(self.queue.as_str().into()),
            );
            declare(channel, &self.retry_queue(*delay), arguments).await?;
        }
        declare(channel, &self.dead_letters(), FieldTable::default()).await?;

        let mut consumer = channel
            .basic_consume(
                self.queue.as_str().into(),
                self.consumer_tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(BrokerError::broker)?;
        let tag = consumer.tag();
        let context = Arc::new(Context {
            channel: channel.clone(),
            queue: self.queue.clone(),
            retry_queues: delays.iter().map(|d| (*d, self.retry_queue(*d))).collect(),
            dead_letters: self.dead_letters(),
        });
        let deliveries = consumer.by_ref().map(|delivery| {
            delivery
                .map(|delivery| AmqpDelivery {
                    delivery,
                    context: context.clone(),
                })
                .map_err(BrokerError::broker)
        });
        let driven = drive(
            deliveries,
            self.options.shutdown.clone(),
            workers,
            take,
            process,
        )
        .await;
        // No more deliveries: cancel the consumer, and hand back those received but not started.
        let cancelled = channel
            .basic_cancel(tag, BasicCancelOptions::default())
            .await;
        if cancelled.is_ok() {
            while let Ok(Some(Ok(delivery))) =
                tokio::time::timeout(Duration::from_millis(100), consumer.next()).await
            {
                let _ = delivery
                    .nack(BasicNackOptions {
                        requeue: true,
                        ..BasicNackOptions::default()
                    })
                    .await;
            }
        }
        driven?;
        Ok(self.options.counters.snapshot())
    }
}

/// Declares a durable queue with `arguments`.
async fn declare(channel: &Channel, queue: &str, arguments: FieldTable) -> Result<(), BrokerError> {
    channel
        .queue_declare(queue.into(), QueueDeclareOptions::durable(), arguments)
        .await
        .map(drop)
        .map_err(BrokerError::broker)
}

/// What every delivery of one runner needs to settle.
struct Context {
    channel: Channel,
    queue: String,
    retry_queues: Vec<(Duration, String)>,
    dead_letters: String,
}

struct AmqpDelivery {
    delivery: lapin::message::Delivery,
    context: Arc<Context>,
}

impl AmqpDelivery {
    /// Publishes a copy of the message to `queue` with `headers` added, persistent, and waits for
    /// the broker's confirmation.
    async fn republish(
        &self,
        queue: &str,
        headers: Vec<(&str, AMQPValue)>,
        what: &'static str,
    ) -> Result<(), BrokerError> {
        let properties = &self.delivery.properties;
        let mut table = properties.headers().clone().unwrap_or_default();
        for (name, value) in headers {
            table.insert(name.into(), value);
        }
        let properties: BasicProperties =
            properties.clone().with_headers(table).with_delivery_mode(2);
        let confirm = self
            .context
            .channel
            .basic_publish(
                ShortString::from(""),
                queue.into(),
                BasicPublishOptions::default(),
                &self.delivery.data,
                properties,
            )
            .await
            .map_err(BrokerError::broker)?
            .await
            .map_err(BrokerError::broker)?;
        match confirm {
            Confirmation::Ack(None) => Ok(()),
            _ => Err(BrokerError::Refused { what }),
        }
    }

    async fn ack(&self) -> Result<(), BrokerError> {
        self.delivery
            .ack(BasicAckOptions::default())
            .await
            .map(drop)
            .map_err(BrokerError::broker)
    }
}

impl Delivery for AmqpDelivery {
    fn message(&self) -> Result<Message, String> {
        let properties = &self.delivery.properties;
        let message_id = properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_owned())
            .filter(|id| !id.is_empty())
            .ok_or_else(|| "the message has no message_id property: it has no key".to_owned())?;
        let mut headers = Vec::new();
        let mut attempt = 1;
        if let Some(table) = properties.headers() {
            for (name, value) in table.inner() {
                if name.as_str() == ATTEMPT_HEADER {
                    attempt = integer(value).unwrap_or(1).max(1);
                }
                if let Some(text) = text(value) {
                    headers.push((name.as_str().to_owned(), text));
                }
            }
        }
        Ok(Message {
            message_id: MessageId(message_id),
            payload: self.delivery.data.clone(),
            headers,
            attempt,
            delivery_tag: DeliveryTag(self.delivery.delivery_tag),
            redelivered: Redelivered(self.delivery.redelivered),
            stream_sequence: None,
        })
    }

    async fn settle(self, route: Route) -> Result<(), BrokerError> {
        let republished = match &route {
            Route::Ack => return self.ack().await,
            Route::Retry { attempt, after } => {
                let queue = self
                    .context
                    .retry_queues
                    .iter()
                    .find(|(delay, _)| delay == after)
                    .map(|(_, queue)| queue.clone())
                    .expect("every delay of the policy has its queue");
                let attempt = AMQPValue::LongLongInt(i64::from(*attempt));
                self.republish(&queue, vec![(ATTEMPT_HEADER, attempt)], "retry")
                    .await
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
                        AMQPValue::LongString(self.context.queue.as_str().into()),
                    ),
                ];
                let queue = self.context.dead_letters.clone();
                self.republish(&queue, headers, "dead letter").await
            }
        };
        match republished {
            Ok(()) => self.ack().await,
            Err(error) => {
                // Not moved: hand it back to the broker, which delivers it again.
                tracing::warn!(%error, "could not move a delivery; requeued");
                let _ = self
                    .delivery
                    .nack(BasicNackOptions {
                        requeue: true,
                        ..BasicNackOptions::default()
                    })
                    .await;
                Err(error)
            }
        }
    }
}

fn integer(value: &AMQPValue) -> Option<u32> {
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

fn text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        other => integer(other).map(|n| n.to_string()),
    }
}
