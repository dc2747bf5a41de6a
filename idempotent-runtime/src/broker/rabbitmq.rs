//! The runner for RabbitMQ (AMQP 0-9-1, with `lapin`).
//!
//! ```no_run
//! # use idempotent_runtime as idempotent;
//! use idempotent::broker::rabbitmq::Runner;
//! use idempotent::broker::{Message, RetryPolicy, Shutdown};
//! # async fn demo(inbox: idempotent::Inbox<sqlx::Sqlite>, shutdown: Shutdown) -> Result<(), Box<dyn std::error::Error>> {
//! let stats = Runner::connect("amqp://127.0.0.1:5672/%2f", "payments")
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
//! **Connections.** A runner made with [`Runner::connect`] (or [`Runner::with_connector`]) makes
//! its own connection, and makes it again whenever it is lost (a broker restart, a network cut):
//! it says so once at `warn`, tries again after a back-off (100 ms, doubling, at most 5 s,
//! jittered), says at `info` when it is back, and counts it ([`RunnerStats::reconnects`], the
//! `idempotent_runner_reconnects_total` metric). It never ends for that. A connection that cannot
//! be made at start is waited for the same way. Deliveries in flight when the connection is lost
//! finish; their acknowledgement fails and the broker delivers them again, which the inbox finds to
//! be duplicates. A runner made with [`Runner::new`] from a channel of yours cannot make a new
//! connection: when its channel is lost it returns [`BrokerError::Broker`].
//!
//! **A deleted queue** cancels the runner's consumer (RabbitMQ's consumer cancel notification):
//! the runner returns [`BrokerError::Cancelled`], never `Ok`, which means a shutdown on request.
//!
//! **Retries** go through delay queues: a delivery to try again after `d` is published to the
//! queue `<queue>.retry.<d>ms`, whose messages expire after `d` and are dead-lettered back to
//! `<queue>` by RabbitMQ; once the broker confirmed that publish, the delivery is acknowledged. One
//! queue per delay, so that no message waits behind a longer one. Crash redeliveries (no outcome
//! was reached) are not counted as attempts.
//!
//! **Attempts** are counted from what RabbitMQ itself records when a message expires in one of
//! this runner's delay queues (the `x-death` entries of `<queue>.retry.<d>ms` queues, reason
//! `expired`): only this runner's retries count. A header a producer sets does not: the
//! `x-idempotent-attempt` header the runner writes on a retry is for people to read, and the
//! runner does not read it back. A dead letter is published without the delay queues' `x-death`
//! entries and without that header, so a dead letter moved back to `<queue>` on purpose starts
//! again at attempt 1 with all its attempts. (Forging RabbitMQ's `x-death` entries of the runner's
//! private delay queues is the one way to shorten a message's attempts; no producer does that by
//! accident.)
//!
//! **Dead letters** are published to `<queue>.dead` (or the queue you name) with the headers
//! `x-idempotent-reason`, `x-idempotent-attempts`, `x-idempotent-queue` and
//! `x-idempotent-dead-lettered-at`, and acknowledged once
//! the broker confirmed them. The runner declares these queues (durable) when it starts (and on
//! each reconnect): a dead-letter queue the broker refuses to declare (it exists with other
//! arguments, another connection holds it exclusively) stops the runner at start with
//! [`BrokerError::DeadLetterTarget`], before it takes a delivery. It puts its channel in
//! publisher-confirm mode.
//!
//! **A retry or dead letter that cannot be published** (the queue was deleted since, so the
//! message is unroutable; the broker refused it; the broker did not confirm it within the
//! [publish timeout](Runner::publish_timeout), 10 s by default, as during a memory alarm; the
//! connection was lost) does not stop the runner: the delivery is held for a back-off of its own
//! (1 s, doubling per failure of that message, at most a minute), then handed back to the broker
//! (`nack` with requeue), which delivers it again; the runner goes on with the others. A publish
//! that timed out may still reach the broker later, so the message may then be delivered twice:
//! the inbox finds the second a duplicate once the first is processed.
//!
//! At most `workers` deliveries are unacknowledged at once (`basic.qos`). On shutdown the runner
//! cancels its consumer, settles the deliveries in flight, and returns to the broker (`nack` with
//! requeue) those it had received but not started.

/// The AMQP client this runner was built against: make the runner's channel with it.
pub use lapin;

mod publisher;
pub use publisher::OutboxPublisher;

mod confirms;
mod consumer;
mod dead_letters;
mod delay_queues;
mod delivery;
mod headers;

pub use consumer::Connector;
pub use dead_letters::DeadLetterQueue;
pub use headers::{
    ATTEMPT_HEADER, ATTEMPTS_HEADER, DEAD_LETTERED_AT_HEADER, QUEUE_HEADER, REASON_HEADER,
};

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use lapin::{Channel, Connection, ConnectionProperties};

use self::consumer::{ChannelSource, ReconnectingConsumer};
use self::delay_queues::{retry_delays, retry_queue};
use self::delivery::{AmqpDelivery, RunnerSetup};
use crate::broker::drive::{DeliveriesAtOnce, drive};
use crate::broker::error::BrokerError;
use crate::broker::options::RunnerOptions;
use crate::broker::outage::Outage;
use crate::broker::stats::RunnerStats;

/// Consumes one queue and settles each delivery by its handler's outcome; see the
/// [module docs](self).
pub struct Runner {
    source: ChannelSource,
    queue: String,
    dead_letter_queue: Option<String>,
    consumer_tag: String,
    options: RunnerOptions,
}

impl fmt::Debug for Runner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runner")
            .field("queue", &self.queue)
            .field(
                "reconnects",
                &matches!(self.source, ChannelSource::Connector(_)),
            )
            .field("workers", &self.options.workers)
            .field("retry", &self.options.retry)
            .finish_non_exhaustive()
    }
}

impl Runner {
    /// Creates a runner consuming `queue` on a connection it makes to `url` (`amqp://…`), and makes
    /// again whenever it is lost; with one worker, the default [`RetryPolicy`](super::RetryPolicy) and dead letters to
    /// `<queue>.dead`. The queue must exist.
    pub fn connect(url: impl Into<String>, queue: impl Into<String>) -> Self {
        let url: Arc<str> = url.into().into();
        Self::with_connector(
            move || {
                let url = url.clone();
                async move { Connection::connect(&url, ConnectionProperties::default()).await }
            },
            queue,
        )
    }

    /// Creates a runner consuming `queue` on connections `connect` makes (for TLS, or connection
    /// properties of your own): one at start, and a new one whenever the last one is lost.
    pub fn with_connector<F, Fut>(connect: F, queue: impl Into<String>) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Connection, lapin::Error>> + Send + 'static,
    {
        let connector: Connector = Arc::new(move || Box::pin(connect()));
        Self::from_source(ChannelSource::Connector(connector), queue.into())
    }

    /// Creates a runner consuming `queue` on `channel`, with one worker, the default
    /// [`RetryPolicy`](super::RetryPolicy) and dead letters to `<queue>.dead`. The queue must exist. It cannot
    /// reconnect: when the channel is lost it returns [`BrokerError::Broker`]. It publishes its
    /// retries and dead letters on that channel, one at a time: publish nothing else on it (a
    /// returned message is known to be the runner's only while nothing else awaits a confirmation
    /// there). Prefer [`connect`](Self::connect).
    pub fn new(channel: Channel, queue: impl Into<String>) -> Self {
        Self::from_source(ChannelSource::Channel(Some(channel)), queue.into())
    }

    fn from_source(source: ChannelSource, queue: String) -> Self {
        Self {
            source,
            queue,
            dead_letter_queue: None,
            consumer_tag: String::new(),
            options: RunnerOptions::default(),
        }
    }

    /// Dead-letters to `queue` instead of `<queue>.dead`.
    pub fn dead_letter_queue(self, queue: impl Into<String>) -> Self {
        Self {
            dead_letter_queue: Some(queue.into()),
            ..self
        }
    }

    /// Returns the queue dead letters go to.
    pub fn dead_letters(&self) -> String {
        self.dead_letter_queue
            .clone()
            .unwrap_or_else(|| format!("{}.dead", self.queue))
    }

    super::options::runner_builder! {
        /// Runs `workers` handlers at once (and lets as many deliveries be unacknowledged).
        workers;
        /// Waits at most `timeout` for the broker to confirm a retry or a dead letter the runner
        /// publishes (default [`DEFAULT_PUBLISH_TIMEOUT`](super::DEFAULT_PUBLISH_TIMEOUT), 10 s);
        /// past it, the delivery is handed back to the broker after a back-off.
        publish_timeout;
        /// Consumes until the shutdown token is cancelled (or the broker cancels the consumer, or
        /// refuses the runner's setup), with a handler from `new_worker` per worker. Returns what it
        /// counted.
        run;
    }

    /// Connects (and reconnects), declares the runner's queues, consumes, and drives the workers.
    async fn consume<W, P, PF>(
        self,
        workers: Vec<W>,
        take: DeliveriesAtOnce,
        process: P,
    ) -> Result<RunnerStats, BrokerError>
    where
        W: Send + 'static,
        P: FnMut(W, Vec<AmqpDelivery>) -> PF,
        PF: Future<Output = W> + Send + 'static,
    {
        let retry = self.options.retry;
        let delays = retry_delays(&retry);
        let setup = Arc::new(RunnerSetup {
            queue: self.queue.clone(),
            retry_queues: delays
                .iter()
                .map(|delay| (*delay, retry_queue(&self.queue, *delay)))
                .collect(),
            dead_letters: self.dead_letters(),
            consumer_tag: self.consumer_tag.clone(),
            prefetch: (self.options.workers * take.most).min(u16::MAX as usize) as u16,
            publish_timeout: self.options.publish_timeout,
        });
        let outage = Outage::new(
            "rabbitmq",
            self.queue.clone(),
            Some(self.options.counters.clone()),
        );
        let mut consumer = ReconnectingConsumer::new(self.source, setup, outage);
        let deliveries = futures_util::stream::unfold(&mut consumer, |consumer| async move {
            let next = consumer.next().await;
            Some((next, consumer))
        });
        let driven = drive(
            deliveries,
            self.options.shutdown.clone(),
            workers,
            take,
            process,
        )
        .await;
        // No more deliveries: cancel the consumer, and hand back those received but not started;
        // a broker that does not answer (a blocked connection) is not waited for past the publish
        // timeout: what it holds unacknowledged it delivers again.
        let publish_timeout = self.options.publish_timeout;
        let _ = tokio::time::timeout(publish_timeout, consumer.close()).await;
        driven?;
        Ok(self.options.counters.snapshot())
    }
}

/// Whether `error` is the broker's refusal of what was asked on a channel (a channel-level error,
/// after which RabbitMQ closes that channel: a missing queue or exchange, a queue declared with
/// other arguments or held exclusively elsewhere, no permission, a message over
/// `max_message_size`), as opposed to a lost connection. Not while `connection` (the channel's, when
/// known) is closed: lapin fails every channel of a connection with the error that closed it,
/// which can carry a channel's code (its own 406 for a broker's acknowledgement of a publication
/// never sent), and that is nothing the broker refused.
fn is_refusal(error: &lapin::Error, connection: Option<&Connection>) -> bool {
    matches!(
        error.kind(),
        lapin::ErrorKind::ProtocolError(amqp)
            if matches!(amqp.kind(), lapin::protocol::AMQPErrorKind::Soft(_))
    ) && connection.is_none_or(|connection| connection.status().connected())
}
