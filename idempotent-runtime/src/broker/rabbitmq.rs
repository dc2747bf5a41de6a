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
//! `x-idempotent-reason`, `x-idempotent-attempts` and `x-idempotent-queue`, and acknowledged once
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

use std::collections::BTreeSet;
use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};

use super::Shutdown;
use super::batch::{BatchBody, Batches};
use super::delivery::Delivery;
use super::drive::{DeliveriesAtOnce, drive};
use super::error::BrokerError;
use super::message::{Message, MessageId, Redelivered};
use super::options::RunnerOptions;
use super::outage::Outage;
use super::retry::RetryPolicy;
use super::route::Route;
use super::settle::BeforeSettle;
use super::stats::RunnerStats;
use crate::error::Error;
use crate::inbox::{Handled, Inbox};
use crate::markers::DeliveryTag;
use crate::store::Backend;

/// The header that carries a retried delivery's attempt number, for people to read (the runner
/// counts attempts from RabbitMQ's own `x-death` entries; see the [module docs](self)).
pub const ATTEMPT_HEADER: &str = "x-idempotent-attempt";
/// The header that carries a dead letter's reason.
pub const REASON_HEADER: &str = "x-idempotent-reason";
/// The header that carries the number of attempts a dead letter had.
pub const ATTEMPTS_HEADER: &str = "x-idempotent-attempts";
/// The header that names the queue a dead letter came from.
pub const QUEUE_HEADER: &str = "x-idempotent-queue";

/// Makes a connection to the broker, for a runner that reconnects by itself; see
/// [`Runner::with_connector`].
pub type Connector =
    Arc<dyn Fn() -> BoxFuture<'static, Result<Connection, lapin::Error>> + Send + Sync>;

/// Where a runner's channels come from.
enum Source {
    /// A channel the user made: used once, no reconnecting.
    Channel(Option<Channel>),
    /// New connections, as many as it takes.
    Connector(Connector),
}

/// Consumes one queue and settles each delivery by its handler's outcome; see the
/// [module docs](self).
pub struct Runner {
    source: Source,
    queue: String,
    dead_letter_queue: Option<String>,
    consumer_tag: String,
    options: RunnerOptions,
}

impl fmt::Debug for Runner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runner")
            .field("queue", &self.queue)
            .field("reconnects", &matches!(self.source, Source::Connector(_)))
            .field("workers", &self.options.workers)
            .field("retry", &self.options.retry)
            .finish_non_exhaustive()
    }
}

impl Runner {
    /// A runner consuming `queue` on a connection it makes to `url` (`amqp://…`), and makes again
    /// whenever it is lost; with one worker, the default [`RetryPolicy`] and dead letters to
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

    /// A runner consuming `queue` on connections `connect` makes (for TLS, or connection
    /// properties of your own): one at start, and a new one whenever the last one is lost.
    pub fn with_connector<F, Fut>(connect: F, queue: impl Into<String>) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Connection, lapin::Error>> + Send + 'static,
    {
        let connector: Connector = Arc::new(move || Box::pin(connect()));
        Self::from_source(Source::Connector(connector), queue.into())
    }

    /// A runner consuming `queue` on `channel`, with one worker, the default [`RetryPolicy`] and
    /// dead letters to `<queue>.dead`. The queue must exist. It cannot reconnect: when the channel
    /// is lost it returns [`BrokerError::Broker`]. Prefer [`connect`](Self::connect).
    pub fn new(channel: Channel, queue: impl Into<String>) -> Self {
        Self::from_source(Source::Channel(Some(channel)), queue.into())
    }

    fn from_source(source: Source, queue: String) -> Self {
        Self {
            source,
            queue,
            dead_letter_queue: None,
            consumer_tag: String::new(),
            options: RunnerOptions::default(),
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

    /// Waits at most `timeout` for the broker to confirm a retry or a dead letter the runner
    /// publishes (default [`DEFAULT_PUBLISH_TIMEOUT`](super::DEFAULT_PUBLISH_TIMEOUT), 10 s);
    /// past it, the delivery is handed back to the broker after a back-off.
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.options.publish_timeout = timeout;
        self
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

    /// Consumes until the shutdown token is cancelled (or the broker cancels the consumer, or
    /// refuses the runner's setup), with a handler from `new_worker` per worker. Returns what it
    /// counted.
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
        let setup = Arc::new(Setup {
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
        let mut feed = Feed {
            source: self.source,
            setup,
            session: None,
            outage: Outage::new(
                "rabbitmq",
                self.queue.clone(),
                Some(self.options.counters.clone()),
            ),
        };
        let deliveries = futures_util::stream::unfold(&mut feed, |feed| async move {
            let next = feed.next().await;
            Some((next, feed))
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
        let _ = tokio::time::timeout(publish_timeout, feed.close()).await;
        driven?;
        Ok(self.options.counters.snapshot())
    }
}

impl Feed {
    /// Cancels the consumer, and hands back the deliveries received but not started.
    async fn close(&mut self) {
        if let Some(mut session) = self.session.take() {
            let tag = session.consumer.tag();
            let cancelled = session
                .channel
                .basic_cancel(tag, BasicCancelOptions::default())
                .await;
            if cancelled.is_ok() {
                while let Ok(Some(Ok(delivery))) =
                    tokio::time::timeout(Duration::from_millis(100), session.consumer.next()).await
                {
                    let _ = delivery
                        .nack(BasicNackOptions {
                            requeue: true,
                            ..BasicNackOptions::default()
                        })
                        .await;
                }
            }
        }
    }
}

/// The delays of a policy's retries, one delay queue each: at most 100, the last of them the
/// longest (a later retry goes to the longest queue not longer than its delay).
fn retry_delays(policy: &RetryPolicy) -> BTreeSet<Duration> {
    let mut delays = BTreeSet::new();
    for attempt in 1..policy.max_attempts {
        let delay = policy.delay_after(attempt);
        delays.insert(delay);
        if delay >= policy.max_delay || delays.len() >= 100 {
            break;
        }
    }
    delays
}

/// The delay queue of `queue`'s retries after `delay`.
fn retry_queue(queue: &str, delay: Duration) -> String {
    format!("{queue}.retry.{}ms", delay.as_millis())
}

/// Whether `name` is one of `queue`'s delay queues (`<queue>.retry.<n>ms`).
fn is_retry_queue(queue: &str, name: &[u8]) -> bool {
    name.strip_prefix(queue.as_bytes())
        .and_then(|rest| rest.strip_prefix(b".retry."))
        .and_then(|rest| rest.strip_suffix(b"ms"))
        .is_some_and(|digits| !digits.is_empty() && digits.iter().all(u8::is_ascii_digit))
}

/// What a runner sets up on each connection, and what its deliveries need to settle.
struct Setup {
    queue: String,
    retry_queues: Vec<(Duration, String)>,
    dead_letters: String,
    consumer_tag: String,
    prefetch: u16,
    publish_timeout: Duration,
}

/// A connection's channel and the runner's consumer on it.
struct Session {
    /// The connection the runner made, if it did.
    connection: Option<Connection>,
    channel: Channel,
    consumer: lapin::Consumer,
    context: Arc<Context>,
}

/// Why a session could not be opened.
enum OpenError {
    /// The broker is away (or the connection broke): try again after a back-off.
    Lost(lapin::Error),
    /// The broker refused the runner's setup, or there is no way to reconnect: the runner stops.
    Fatal(BrokerError),
}

/// The runner's deliveries, from one session after another.
struct Feed {
    source: Source,
    setup: Arc<Setup>,
    session: Option<Session>,
    outage: Outage,
}

impl Feed {
    /// The next delivery, reconnecting as long as it takes; an error only when the runner cannot
    /// go on.
    async fn next(&mut self) -> Result<AmqpDelivery, BrokerError> {
        loop {
            let session = match self.session.as_mut() {
                Some(session) => session,
                None => match self.open().await {
                    Ok(session) => {
                        self.outage.restored();
                        self.session.insert(session)
                    }
                    Err(OpenError::Fatal(error)) => return Err(error),
                    Err(OpenError::Lost(error)) => {
                        let after = self.outage.failed(&error);
                        tokio::time::sleep(after).await;
                        continue;
                    }
                },
            };
            match session.consumer.next().await {
                Some(Ok(delivery)) => {
                    return Ok(AmqpDelivery {
                        delivery,
                        context: session.context.clone(),
                    });
                }
                Some(Err(error)) => {
                    self.session = None;
                    let after = self.outage.failed(&error);
                    tokio::time::sleep(after).await;
                }
                None => {
                    // The consumer ended without an error: the broker cancelled it, which it
                    // does when its queue is deleted, or the connection went away.
                    let session = self.session.take().expect("a session");
                    if let Some(error) = self.cancelled(&session).await {
                        return Err(error);
                    }
                    if let Source::Channel(slot) = &mut self.source {
                        // Consumed again on the same channel, if it is still open.
                        *slot = Some(session.channel.clone());
                    }
                    // Not at once: a broker that cancels again and again is not asked in a loop.
                    let ended = std::io::Error::other("the broker ended the runner's consumer");
                    let after = self.outage.failed(&ended);
                    tokio::time::sleep(after).await;
                }
            }
        }
    }

    /// Why `session`'s consumer ended: [`BrokerError::Cancelled`] when its queue is gone.
    async fn cancelled(&self, session: &Session) -> Option<BrokerError> {
        let queue = self.setup.queue.as_str();
        let probe = async {
            // On a channel of its own where it can: a missing queue closes the channel it is
            // asked on.
            let channel = match &session.connection {
                Some(connection) => connection.create_channel().await?,
                None => session.channel.clone(),
            };
            let declared = channel
                .queue_declare(
                    queue.into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await;
            if declared.is_ok() && session.connection.is_some() {
                let _ = channel.close(200, "".into()).await;
            }
            declared
        };
        match tokio::time::timeout(self.setup.publish_timeout, probe).await {
            Ok(Err(error)) if soft(&error) => {
                tracing::warn!(queue, %error, "the broker cancelled the runner's consumer");
                Some(BrokerError::Cancelled {
                    source_name: queue.to_owned(),
                })
            }
            _ => {
                tracing::warn!(
                    queue,
                    "the runner's consumer ended while its queue is there; consuming again"
                );
                None
            }
        }
    }

    /// A channel (a new connection's, where the runner can make one) set up for the runner, and
    /// its consumer.
    async fn open(&mut self) -> Result<Session, OpenError> {
        let (connection, channel) = match &mut self.source {
            Source::Channel(channel) => match channel.take() {
                Some(channel) => (None, channel),
                None => {
                    return Err(OpenError::Fatal(BrokerError::Broker(
                        "the runner's channel was lost, and a runner made from a channel cannot \
                         reconnect (make it with Runner::connect)"
                            .into(),
                    )));
                }
            },
            Source::Connector(connect) => {
                let connection = connect().await.map_err(OpenError::Lost)?;
                let channel = connection.create_channel().await.map_err(OpenError::Lost)?;
                (Some(connection), channel)
            }
        };
        let setup = &self.setup;
        let classify = |error: lapin::Error| {
            if soft(&error) {
                OpenError::Fatal(BrokerError::broker(error))
            } else {
                OpenError::Lost(error)
            }
        };
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(classify)?;
        channel
            .basic_qos(setup.prefetch, BasicQosOptions::default())
            .await
            .map_err(classify)?;
        for (delay, queue) in &setup.retry_queues {
            let mut arguments = FieldTable::default();
            arguments.insert(
                "x-message-ttl".into(),
                AMQPValue::LongLongInt(delay.as_millis().min(i64::MAX as u128) as i64),
            );
            arguments.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString("".into()),
            );
            arguments.insert(
                "x-dead-letter-routing-key".into(),
                AMQPValue::LongString(setup.queue.as_str().into()),
            );
            declare(&channel, queue, arguments)
                .await
                .map_err(classify)?;
        }
        declare(&channel, &setup.dead_letters, FieldTable::default())
            .await
            .map_err(|error| {
                if soft(&error) {
                    OpenError::Fatal(BrokerError::DeadLetterTarget {
                        target: setup.dead_letters.clone(),
                        reason: format!("the broker refused to declare the queue: {error}"),
                    })
                } else {
                    OpenError::Lost(error)
                }
            })?;
        let consumer = channel
            .basic_consume(
                setup.queue.as_str().into(),
                setup.consumer_tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(classify)?;
        let context = Arc::new(Context {
            channel: channel.clone(),
            setup: setup.clone(),
        });
        Ok(Session {
            connection,
            channel,
            consumer,
            context,
        })
    }
}

/// Whether `error` is the broker's refusal of what the runner asked (a channel-level error: a
/// missing queue, a queue declared with other arguments, one held exclusively elsewhere), as
/// opposed to a lost connection.
fn soft(error: &lapin::Error) -> bool {
    matches!(
        error.kind(),
        lapin::ErrorKind::ProtocolError(amqp)
            if matches!(amqp.kind(), lapin::protocol::AMQPErrorKind::Soft(_))
    )
}

/// Declares a durable queue with `arguments`.
async fn declare(
    channel: &Channel,
    queue: &str,
    arguments: FieldTable,
) -> Result<(), lapin::Error> {
    channel
        .queue_declare(queue.into(), QueueDeclareOptions::durable(), arguments)
        .await
        .map(drop)
}

/// What every delivery of one session needs to settle.
struct Context {
    channel: Channel,
    setup: Arc<Setup>,
}

struct AmqpDelivery {
    delivery: lapin::message::Delivery,
    context: Arc<Context>,
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
                .channel
                .basic_publish(
                    ShortString::from(""),
                    queue.into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..BasicPublishOptions::default()
                    },
                    &self.delivery.data,
                    properties,
                )
                .await
                .map_err(BrokerError::broker)?
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delay_queues_are_recognised_by_name() {
        assert!(is_retry_queue("q", b"q.retry.100ms"));
        assert!(!is_retry_queue("q", b"q.retry.ms"));
        assert!(!is_retry_queue("q", b"q.dead"));
        assert!(!is_retry_queue("q", b"other.retry.100ms"));
        assert!(!is_retry_queue("q", b"q.retry.1x0ms"));
    }

    #[test]
    fn a_policy_of_any_size_has_few_delay_queues() {
        let policy = RetryPolicy::new(u32::MAX, Duration::from_millis(1)).multiplier(1.0001);
        let delays = retry_delays(&policy);
        assert!(!delays.is_empty() && delays.len() <= 100);
        let policy =
            RetryPolicy::new(100, Duration::from_secs(1)).max_delay(Duration::from_secs(4));
        let delays: Vec<u64> = retry_delays(&policy).iter().map(|d| d.as_secs()).collect();
        assert_eq!(delays, [1, 2, 4]);
    }
}
