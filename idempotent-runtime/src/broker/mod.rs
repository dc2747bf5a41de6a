//! Broker runners: what a consumer does with each outcome, written once.
//!
//! A runner takes deliveries from a broker (a RabbitMQ queue, a NATS JetStream pull consumer: the
//! `rabbitmq` and `nats` modules), hands each [`Message`] to a handler (typically an
//! `#[idempotent]` function called with a worker's inbox, made with
//! [`Inbox::for_worker`](crate::Inbox::for_worker)), and settles the delivery only once the outcome
//! is known: acknowledged when processed or a duplicate, delivered again after a back-off
//! ([`RetryPolicy`]) when the error [is retryable](crate::Error::is_retryable) and attempts are
//! left, dead-lettered otherwise. A [`Shutdown`] token stops it gracefully; it ends with a
//! [`BrokerError`] only when it cannot go on, never because its broker restarted.
//!
//! The guide "Brokers and runners" says what each outcome does on each broker, how restarts and
//! unpublishable retries are handled, batch mode, and what is tested: `idempotent::guide::brokers`
//! in the `idempotent-inbox` crate
//! (<https://docs.rs/idempotent-inbox/latest/idempotent/guide/brokers/index.html>).

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::task::JoinSet;

use crate::error::Error;
use crate::inbox::Handled;
use crate::key::{KeyBuilder, StableKey};
use crate::markers::DeliveryTag;

#[cfg(feature = "nats")]
#[cfg_attr(docsrs, doc(cfg(feature = "nats")))]
pub mod nats;
#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub mod rabbitmq;

/// Stops a runner gracefully when cancelled; see the [module docs](self).
pub use tokio_util::sync::CancellationToken as Shutdown;

/// How often, and how far apart, a delivery that failed with a retryable error is tried again.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Attempts in all, the first delivery included (default 5). The last one's retryable error
    /// dead-letters the message.
    pub max_attempts: u32,
    /// The delay before the second attempt (default 1 s).
    pub first_delay: Duration,
    /// Each further delay is the one before times this (default 2).
    pub multiplier: f64,
    /// No delay is longer than this (default 5 minutes).
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            first_delay: Duration::from_secs(1),
            multiplier: 2.0,
            max_delay: Duration::from_secs(300),
        }
    }
}

impl RetryPolicy {
    /// Creates a policy of `max_attempts` attempts, the first retry after `first_delay`, each later
    /// one twice as late.
    pub fn new(max_attempts: u32, first_delay: Duration) -> Self {
        Self {
            max_attempts: max_attempts.max(1),
            first_delay,
            ..Self::default()
        }
    }

    /// Returns the same policy with another multiplier.
    pub fn multiplier(self, multiplier: f64) -> Self {
        Self { multiplier, ..self }
    }

    /// Returns the same policy with another longest delay.
    pub fn max_delay(self, max_delay: Duration) -> Self {
        Self { max_delay, ..self }
    }

    /// Returns how long to wait before attempt `attempt + 1`, after attempt `attempt` (counting
    /// from 1) failed: `first_delay` times `multiplier` to the power `attempt - 1`, and never more
    /// than `max_delay`. Any input gives an answer (no overflow, no panic), and the answers never
    /// shrink as `attempt` grows.
    pub fn delay_after(&self, attempt: u32) -> Duration {
        // NaN and anything below 1 count as 1 (`max` ignores NaN): delays never shrink.
        let multiplier = self.multiplier.max(1.0);
        let exponent = i32::try_from(attempt.saturating_sub(1)).unwrap_or(i32::MAX);
        let (first, longest) = (self.first_delay, self.max_delay);
        if exponent == 0 || first.is_zero() {
            return first.min(longest);
        }
        // Capped before it becomes a `Duration`: a factor of 2^70 (or infinity) must not overflow.
        let seconds = first.as_secs_f64() * multiplier.powi(exponent);
        if seconds.is_nan() || seconds >= longest.as_secs_f64() {
            return longest;
        }
        // Never below the first delay, which the float's rounding could reach.
        Duration::try_from_secs_f64(seconds).map_or(longest, |delay| delay.max(first).min(longest))
    }
}

/// What a runner does with a delivery, given its handler's outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// Acknowledge: the effect is committed, by this delivery or an earlier one.
    Ack,
    /// Deliver it again after `after`, as attempt number `attempt`.
    Retry {
        /// The number of the next attempt, counting from 1.
        attempt: u32,
        /// How long the broker holds it back.
        after: Duration,
    },
    /// Dead-letter it.
    DeadLetter {
        /// Why, for a person to read.
        reason: String,
        /// How many attempts were made.
        attempts: u32,
    },
}

impl Route {
    /// Returns the route of a delivery on its `attempt`-th attempt (counting from 1) whose handler
    /// returned `outcome`.
    pub fn of<T, E: fmt::Display>(
        outcome: &Result<Handled<T>, Error<E>>,
        attempt: u32,
        policy: &RetryPolicy,
    ) -> Self {
        match outcome {
            Ok(_) => Route::Ack,
            Err(error) => Self::failure(error.is_retryable(), &describe(error), attempt, policy),
        }
    }

    /// The route of a delivery on its `attempt`-th attempt that failed, retryably or not, for
    /// `reason`.
    pub(crate) fn failure(
        retryable: bool,
        reason: &str,
        attempt: u32,
        policy: &RetryPolicy,
    ) -> Self {
        if retryable && attempt < policy.max_attempts {
            Route::Retry {
                attempt: attempt + 1,
                after: policy.delay_after(attempt),
            }
        } else if retryable {
            Route::DeadLetter {
                reason: format!("still failing after {attempt} attempts: {reason}"),
                attempts: attempt,
            }
        } else {
            Route::DeadLetter {
                reason: reason.to_owned(),
                attempts: attempt,
            }
        }
    }
}

/// A handler's error as one line: the error, and the causes of an inbox error.
fn describe<E: fmt::Display>(error: &Error<E>) -> String {
    match error {
        Error::Handler(e) | Error::Transient(e) => shorten(e.to_string()),
        Error::Inbox(e) => describe_inbox(e),
    }
}

/// An inbox error and its causes as one line.
fn describe_inbox(error: &crate::error::InboxError) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    shorten(text)
}

/// At most a thousand bytes of `text`.
fn shorten(mut text: String) -> String {
    // Headers are no place for a novel.
    if text.len() > 1000 {
        let mut end = 1000;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

/// The id the producer gave a message (AMQP `message_id`, NATS `Nats-Msg-Id`): the same on every
/// delivery of it, so the key to use.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MessageId(pub String);

impl StableKey for MessageId {
    fn write_key(&self, key: &mut KeyBuilder) {
        self.0.write_key(key)
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A stream's sequence number of a message (JetStream): it changes when a message is published
/// again, so it is not a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamSequence(pub u64);

/// How many times the broker has delivered this message: not a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeliveryCount(pub u64);

/// Whether the broker delivered this message before: not a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Redelivered(pub bool);

/// A delivery as a handler sees it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Message {
    /// The producer's id of the message: key on it.
    pub message_id: MessageId,
    /// The payload.
    pub payload: Vec<u8>,
    /// The headers whose values are text.
    pub headers: Vec<(String, String)>,
    /// This delivery's attempt, counting from 1: the retries the runner scheduled, plus one.
    pub attempt: u32,
    /// The broker's handle of this delivery (AMQP delivery tag; the stream sequence of the
    /// delivery on JetStream): new on every delivery.
    pub delivery_tag: DeliveryTag,
    /// Whether the broker delivered it before (a crash before an acknowledgement).
    pub redelivered: Redelivered,
    /// The stream's sequence number, on JetStream.
    pub stream_sequence: Option<StreamSequence>,
}

impl Message {
    /// Returns the value of header `name`, if it is there and text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }
}

/// What a runner counted, since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunnerStats {
    /// Deliveries acknowledged after their handler processed them.
    pub processed: u64,
    /// Deliveries acknowledged as duplicates.
    pub duplicates: u64,
    /// Deliveries scheduled for another attempt.
    pub retried: u64,
    /// Deliveries dead-lettered.
    pub dead_lettered: u64,
    /// Deliveries handed back to the broker, to be delivered again after a back-off, because their
    /// retry or dead letter could not be published (refused, unroutable, not confirmed within the
    /// publish timeout, or the connection was lost).
    pub released: u64,
    /// Times the runner got its broker back after losing it (a reconnect).
    pub reconnects: u64,
}

/// The live counters behind [`RunnerStats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    processed: AtomicU64,
    duplicates: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    released: AtomicU64,
    reconnects: AtomicU64,
}

impl Counters {
    /// Counts a delivery settled by `route`, which was a duplicate or not.
    fn count(&self, route: &Route, duplicate: bool) {
        let counter = match route {
            Route::Ack if duplicate => &self.duplicates,
            Route::Ack => &self.processed,
            Route::Retry { .. } => &self.retried,
            Route::DeadLetter { .. } => &self.dead_lettered,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> RunnerStats {
        RunnerStats {
            processed: self.processed.load(Ordering::Relaxed),
            duplicates: self.duplicates.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            released: self.released.load(Ordering::Relaxed),
            reconnects: self.reconnects.load(Ordering::Relaxed),
        }
    }
}

/// Called with each delivery's message and route once the outcome is known, before the runner
/// settles the delivery; see the runners' `before_settle`.
pub type BeforeSettle =
    Arc<dyn Fn(&Message, &Route) -> futures_util::future::BoxFuture<'static, ()> + Send + Sync>;

/// What every runner is configured with, whatever its broker.
pub(crate) struct Options {
    pub(crate) workers: usize,
    pub(crate) retry: RetryPolicy,
    pub(crate) shutdown: Shutdown,
    pub(crate) counters: Arc<Counters>,
    pub(crate) before_settle: Option<BeforeSettle>,
    pub(crate) publish_timeout: Duration,
}

/// How long a runner waits, by default, for the broker to confirm a retry or a dead letter it
/// published.
pub const DEFAULT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);

impl Default for Options {
    fn default() -> Self {
        Self {
            workers: 1,
            retry: RetryPolicy::default(),
            shutdown: Shutdown::new(),
            counters: Arc::default(),
            before_settle: None,
            publish_timeout: DEFAULT_PUBLISH_TIMEOUT,
        }
    }
}

impl Options {
    /// What the runner counted so far.
    pub(crate) fn stats(&self) -> impl Fn() -> RunnerStats + Send + Sync + 'static {
        let counters = self.counters.clone();
        move || counters.snapshot()
    }

    fn settler(&self) -> Arc<Settler> {
        Arc::new(Settler {
            policy: self.retry,
            counters: self.counters.clone(),
            before: self.before_settle.clone(),
            shutdown: self.shutdown.clone(),
            held: HeldBack::default(),
        })
    }

    /// A handler from `new_worker` per worker, one delivery at a time: what [`drive`] takes.
    #[allow(clippy::type_complexity)]
    pub(crate) fn one_at_a_time<D, F, W, Fut, T, E>(
        &self,
        mut new_worker: F,
    ) -> (
        Vec<W>,
        Take,
        impl FnMut(W, Vec<D>) -> Processed<W> + use<D, F, W, Fut, T, E>,
    )
    where
        D: Delivery,
        F: FnMut() -> W,
        W: FnMut(Message) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Handled<T>, Error<E>>> + Send,
        T: Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let workers = (0..self.workers).map(|_| new_worker()).collect();
        (workers, Take::ONE, one_at_a_time(self.settler()))
    }

    /// A worker's inbox and a body from `new_body` per worker, `batches` at a time: what
    /// [`drive`] takes.
    #[allow(clippy::type_complexity)]
    pub(crate) fn in_batches<D, DB, F, B, T, E>(
        &self,
        inbox: &crate::inbox::Inbox<DB>,
        consumer: String,
        batches: Batches,
        mut new_body: F,
    ) -> (
        Vec<BatchWorker<DB, B>>,
        Take,
        impl FnMut(BatchWorker<DB, B>, Vec<D>) -> Processed<BatchWorker<DB, B>> + use<D, DB, F, B, T, E>,
    )
    where
        D: Delivery,
        DB: crate::store::Backend,
        F: FnMut() -> B,
        B: BatchBody<DB, T, E>,
        T: Send + 'static,
        E: std::error::Error + Send + 'static,
    {
        let workers = (0..self.workers)
            .map(|_| BatchWorker {
                inbox: inbox.for_worker(),
                body: new_body(),
            })
            .collect();
        (
            workers,
            batches.take(),
            in_batches(consumer.into(), self.settler()),
        )
    }
}

/// What a runner does with outcomes: its retry policy, its counters, and what it calls before it
/// settles a delivery.
pub(crate) struct Settler {
    pub(crate) policy: RetryPolicy,
    pub(crate) counters: Arc<Counters>,
    pub(crate) before: Option<BeforeSettle>,
    pub(crate) shutdown: Shutdown,
    /// The back-off of messages whose retry or dead letter could not be published.
    held: HeldBack,
}

impl Settler {
    /// Counts and settles `delivery` by `route` (`duplicate`: its message was one), after the
    /// hook, which sees its message. When the broker does not take the retry or dead letter, the
    /// delivery is handed back to the broker after a back-off of its own: nothing is lost, and the
    /// runner goes on.
    async fn settle<D: Delivery>(
        &self,
        delivery: D,
        message: Option<&Message>,
        route: Route,
        duplicate: bool,
    ) {
        if let (Some(before), Some(message)) = (&self.before, message) {
            before(message, &route).await;
        }
        let held = message.map_or("", |message| message.message_id.0.as_str());
        match delivery.settle(&route).await {
            Ok(()) => {
                self.counters.count(&route, duplicate);
                self.held.forget(held);
            }
            Err(error) if matches!(route, Route::Ack) => {
                // The effect is committed: the redelivery the broker makes is a duplicate.
                self.counters.count(&route, duplicate);
                tracing::warn!(error = %Chain(&error), "could not acknowledge a delivery; the broker delivers it again");
            }
            Err(error) => {
                let after = self.held.next(held);
                tracing::warn!(
                    error = %Chain(&error),
                    ?after,
                    "could not publish a delivery's retry or dead letter; handed back to the broker after a back-off"
                );
                self.counters.released.fetch_add(1, Ordering::Relaxed);
                if !D::RELEASE_DELAYS {
                    // Held here for the back-off, so that the broker does not hand it straight back.
                    tokio::select! {
                        () = tokio::time::sleep(after) => {}
                        () = self.shutdown.cancelled() => {}
                    }
                }
                delivery.release(after).await;
            }
        }
    }
}

/// An error and its causes, on one line.
pub(crate) struct Chain<'a>(pub(crate) &'a (dyn std::error::Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}

/// Exponential back-off, capped, with some jitter so that runners that lost one broker together do
/// not all come back at the same instant.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    first: Duration,
    longest: Duration,
    failures: u32,
}

impl Backoff {
    pub(crate) const fn new(first: Duration, longest: Duration) -> Self {
        Self {
            first,
            longest,
            failures: 0,
        }
    }

    /// The wait after one more failure.
    pub(crate) fn next(&mut self) -> Duration {
        let delay = RetryPolicy {
            max_attempts: u32::MAX,
            first_delay: self.first,
            multiplier: 2.0,
            max_delay: self.longest,
        }
        .delay_after(self.failures.saturating_add(1));
        self.failures = self.failures.saturating_add(1);
        jitter(delay)
    }

    pub(crate) fn reset(&mut self) {
        self.failures = 0;
    }
}

/// `delay` give or take a quarter.
fn jitter(delay: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(std::time::Instant::now().elapsed().as_nanos());
    let unit = (hasher.finish() % 1_000) as f64 / 1_000.0; // [0, 1)
    delay.mul_f64(0.75 + unit / 2.0)
}

/// The back-off of each message whose retry or dead letter the broker did not take: 1 s, doubling
/// up to a minute, forgotten once its message is settled. At most [`HeldBack::MOST`] messages are
/// remembered (beyond that, the oldest memory is dropped and such a message starts again at 1 s).
#[derive(Debug, Default)]
struct HeldBack {
    failures: std::sync::Mutex<std::collections::HashMap<String, Backoff>>,
}

impl HeldBack {
    const MOST: usize = 10_000;
    const FIRST: Duration = Duration::from_secs(1);
    const LONGEST: Duration = Duration::from_secs(60);

    fn next(&self, message_id: &str) -> Duration {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        if failures.len() >= Self::MOST && !failures.contains_key(message_id) {
            failures.clear();
        }
        failures
            .entry(message_id.to_owned())
            .or_insert_with(|| Backoff::new(Self::FIRST, Self::LONGEST))
            .next()
    }

    fn forget(&self, message_id: &str) {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        if !failures.is_empty() {
            failures.remove(message_id);
        }
    }
}

/// A runner's view of its broker's availability: it says once, at `warn`, that the broker was
/// lost, waits a capped, jittered back-off between attempts to get it back, and says at `info`
/// when it is back (counted in [`RunnerStats::reconnects`] and the
/// [`idempotent_runner_reconnects_total`](crate::metrics::RUNNER_RECONNECTS) counter).
pub(crate) struct Outage {
    broker: &'static str,
    source: String,
    /// Where reconnects are counted; `None` where another watch counts them.
    counters: Option<Arc<Counters>>,
    backoff: Backoff,
    since: Option<std::time::Instant>,
}

impl Outage {
    /// Waits from 100 ms, doubling, up to 5 s between attempts.
    const FIRST: Duration = Duration::from_millis(100);
    const LONGEST: Duration = Duration::from_secs(5);

    pub(crate) fn new(
        broker: &'static str,
        source: String,
        counters: Option<Arc<Counters>>,
    ) -> Self {
        Self {
            broker,
            source,
            counters,
            backoff: Backoff::new(Self::FIRST, Self::LONGEST),
            since: None,
        }
    }

    /// Notes that the broker failed with `error`; returns how long to wait before trying again.
    pub(crate) fn failed(&mut self, error: &(dyn std::error::Error + 'static)) -> Duration {
        let after = self.backoff.next();
        if self.since.is_none() {
            self.since = Some(std::time::Instant::now());
            tracing::warn!(
                broker = self.broker,
                source = %self.source,
                error = %Chain(error),
                "lost the broker; reconnecting"
            );
        } else {
            tracing::debug!(broker = self.broker, source = %self.source, error = %Chain(error), ?after, "the broker is still away");
        }
        after
    }

    /// Notes that the broker answers again.
    pub(crate) fn restored(&mut self) {
        self.backoff.reset();
        if let Some(since) = self.since.take() {
            if let Some(counters) = &self.counters {
                counters.reconnects.fetch_add(1, Ordering::Relaxed);
                crate::metrics::runner_reconnected(self.broker, &self.source);
            }
            tracing::info!(
                broker = self.broker,
                source = %self.source,
                away = ?since.elapsed(),
                "reconnected to the broker"
            );
        }
    }
}

/// Why a runner stopped other than by its [`Shutdown`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// The broker's client failed in a way the runner cannot recover from by itself: a channel it
    /// was given (the RabbitMQ runner's `Runner::new`) lost its connection, or the broker refused the
    /// runner's setup (a queue it declares, its consumer). Deliveries not acknowledged are
    /// delivered again by the broker.
    #[error("the broker failed")]
    Broker(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The broker refused a message the runner published (a retry or a dead letter), or could not
    /// route it. The runner does not stop for this: it hands the delivery back to the broker after
    /// a back-off (see [`RunnerStats::released`]).
    #[error("the broker refused the {what} of a message")]
    Refused {
        /// What was published: "retry" or "dead letter".
        what: &'static str,
    },
    /// The broker did not confirm a message the runner published within the runner's publish
    /// timeout (a memory or disk alarm blocks publishers). The runner does not stop for this: it
    /// hands the delivery back to the broker after a back-off.
    #[error("the broker did not confirm the {what} of a message within {after:?}")]
    Timeout {
        /// What was published: "retry" or "dead letter".
        what: &'static str,
        /// The publish timeout.
        after: Duration,
    },
    /// The broker cancelled the runner's consumer: its queue was deleted (RabbitMQ), or its
    /// consumer or stream (JetStream). Not a shutdown: nothing is consumed any more.
    #[error("the broker cancelled the consumer of {source_name}: it was deleted")]
    Cancelled {
        /// The queue, or the JetStream consumer.
        source_name: String,
    },
    /// The JetStream consumer does not acknowledge each message on its own (its ack policy is
    /// `All` or `None`): with several workers finishing out of order, one acknowledgement would
    /// settle messages still in flight, and a crash would lose them. Found at start; use
    /// `AckPolicy::Explicit`.
    #[error("the consumer's ack policy is {found}; the runner needs AckPolicy::Explicit")]
    AckPolicy {
        /// The consumer's ack policy.
        found: String,
    },
    /// The dead-letter target does not work: no JetStream stream captures the dead-letter subject,
    /// or RabbitMQ refused to declare the dead-letter queue. Found at start, before any delivery
    /// is taken.
    #[error("dead letters cannot go to {target}: {reason}")]
    DeadLetterTarget {
        /// The subject or queue.
        target: String,
        /// Why.
        reason: String,
    },
}

impl BrokerError {
    pub(crate) fn broker(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        BrokerError::Broker(Box::new(error))
    }
}

/// One delivery from a broker, as the shared driver handles it.
pub(crate) trait Delivery: Send + 'static {
    /// The message for the handler, or the reason to dead-letter it without one.
    fn message(&self) -> Result<Message, String>;

    /// Whether [`release`](Self::release) itself makes the broker wait (JetStream's delayed
    /// `nak`); otherwise the runner holds the delivery for the back-off before it releases it.
    const RELEASE_DELAYS: bool;

    /// Settles the delivery by `route`: acknowledges it, or publishes its retry or dead letter and
    /// then acknowledges it. An error leaves the delivery unsettled.
    fn settle(&self, route: &Route) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Hands the delivery back to the broker, to be delivered again (after `after`, where the
    /// broker can wait).
    fn release(self, after: Duration) -> impl Future<Output = ()> + Send;

    /// Keeps the delivery alive while its handler runs (JetStream's in-progress acks); never
    /// returns while it works.
    fn keep_alive(&self) -> impl Future<Output = ()> + Send + '_ {
        std::future::pending()
    }
}

/// How many deliveries a worker takes at once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Take {
    /// At most this many.
    pub(crate) most: usize,
    /// Waiting at most this long for more, once it has one.
    pub(crate) linger: Duration,
}

impl Take {
    /// One delivery at a time.
    pub(crate) const ONE: Take = Take {
        most: 1,
        linger: Duration::ZERO,
    };
}

/// Takes deliveries while a worker is free and the runner is not shut down, `take` at a time,
/// and runs them on the free worker with `process`, which hands the worker back when it is done;
/// returns when `deliveries` ends or fails (the broker's errors the runner cannot recover from) or
/// `shutdown` is cancelled, once every delivery in flight is settled.
pub(crate) async fn drive<D, S, W, P, PF>(
    deliveries: S,
    shutdown: Shutdown,
    workers: Vec<W>,
    take: Take,
    mut process: P,
) -> Result<(), BrokerError>
where
    D: Delivery,
    S: futures_util::Stream<Item = Result<D, BrokerError>>,
    W: Send + 'static,
    P: FnMut(W, Vec<D>) -> PF,
    PF: Future<Output = W> + Send + 'static,
{
    use futures_util::StreamExt;
    let mut deliveries = std::pin::pin!(deliveries);
    let (idle_tx, mut idle) = tokio::sync::mpsc::channel(workers.len().max(1));
    for worker in workers {
        idle_tx.send(worker).await.expect("the receiver is here");
    }
    let mut running = JoinSet::new();
    let mut failure = None;
    'run: loop {
        // A free worker first, so that no delivery waits in the runner for one.
        let worker = tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            Some(finished) = running.join_next(), if !running.is_empty() => {
                finished.expect("a worker task panicked");
                continue;
            }
            worker = idle.recv() => worker.expect("the sender is here"),
        };
        let mut unit = Vec::with_capacity(take.most);
        let deadline = tokio::time::Instant::now() + take.linger;
        while unit.len() < take.most {
            let more = async {
                if unit.is_empty() {
                    deliveries.next().await
                } else {
                    // Once it has one, a worker waits for more until the deadline only.
                    tokio::time::timeout_at(deadline, deliveries.next())
                        .await
                        .unwrap_or(None)
                }
            };
            let next = tokio::select! {
                biased;
                () = shutdown.cancelled(), if unit.is_empty() => break 'run,
                next = more => next,
            };
            match next {
                Some(Ok(delivery)) => unit.push(delivery),
                Some(Err(error)) => {
                    failure = Some(error);
                    break;
                }
                None => break,
            }
        }
        if unit.is_empty() {
            break;
        }
        let idle_tx = idle_tx.clone();
        let processed = process(worker, unit);
        running.spawn(async move {
            let worker = processed.await;
            let _ = idle_tx.send(worker).await;
        });
        if failure.is_some() {
            break;
        }
    }
    // Whatever stopped the runner, the deliveries in flight finish and are settled.
    while let Some(finished) = running.join_next().await {
        finished.expect("a worker task panicked");
    }
    failure.map_or(Ok(()), Err)
}

/// What processing a unit of deliveries on a worker comes to: the worker back, once its
/// deliveries are settled (or handed back to the broker).
pub(crate) type Processed<W> = futures_util::future::BoxFuture<'static, W>;

/// The `process` of [`drive`] for handlers of one message at a time.
pub(crate) fn one_at_a_time<D, W, Fut, T, E>(
    settler: Arc<Settler>,
) -> impl FnMut(W, Vec<D>) -> Processed<W>
where
    D: Delivery,
    W: FnMut(Message) -> Fut + Send + 'static,
    Fut: Future<Output = Result<Handled<T>, Error<E>>> + Send,
    T: Send + 'static,
    E: fmt::Display + Send + 'static,
{
    move |mut worker: W, mut unit: Vec<D>| {
        let settler = settler.clone();
        Box::pin(async move {
            let delivery = unit.pop().expect("a unit of one");
            handle(&mut worker, delivery, &settler).await;
            worker
        })
    }
}

/// How a runner collects deliveries into batches: at most `size` messages in one transaction,
/// waiting at most `linger` for more once it has one. See the runners' `run_batches`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Batches {
    /// The most messages in one transaction (default 50; on PostgreSQL keep it under 64, see
    /// [`Inbox::handle_batch_each`](crate::Inbox::handle_batch_each)).
    pub size: usize,
    /// How long a worker waits for more once it has one (default 5 ms).
    pub linger: Duration,
}

impl Default for Batches {
    fn default() -> Self {
        Self {
            size: 50,
            linger: Duration::from_millis(5),
        }
    }
}

impl Batches {
    /// Batches of at most `size` messages, waiting at most `linger` for more.
    pub fn new(size: usize, linger: Duration) -> Self {
        Self {
            size: size.max(1),
            linger,
        }
    }

    pub(crate) fn take(self) -> Take {
        Take {
            most: self.size,
            linger: self.linger,
        }
    }
}

/// The body of a message in a batch: runs on the batch transaction's connection (in a savepoint of
/// its own) and returns its value or its error.
pub trait BatchBody<DB: crate::store::Backend, T, E>: Send + 'static {
    /// Runs the body for `message`.
    fn run<'a>(
        &'a mut self,
        conn: &'a mut DB::Connection,
        message: &'a Message,
    ) -> futures_util::future::BoxFuture<'a, Result<T, E>>;
}

impl<DB, T, E, F> BatchBody<DB, T, E> for F
where
    DB: crate::store::Backend,
    F: for<'a> FnMut(
            &'a mut DB::Connection,
            &'a Message,
        ) -> futures_util::future::BoxFuture<'a, Result<T, E>>
        + Send
        + 'static,
{
    fn run<'a>(
        &'a mut self,
        conn: &'a mut DB::Connection,
        message: &'a Message,
    ) -> futures_util::future::BoxFuture<'a, Result<T, E>> {
        self(conn, message)
    }
}

/// A worker of a runner in batch mode: its inbox, and its body.
pub(crate) struct BatchWorker<DB: crate::store::Backend, B> {
    pub(crate) inbox: crate::inbox::Inbox<DB>,
    pub(crate) body: B,
}

/// The `process` of [`drive`] for batches: one transaction per batch
/// ([`Inbox::handle_batch_each`](crate::Inbox::handle_batch_each)), then each delivery settled by
/// its own outcome.
pub(crate) fn in_batches<D, DB, B, T, E>(
    consumer: Arc<str>,
    settler: Arc<Settler>,
) -> impl FnMut(BatchWorker<DB, B>, Vec<D>) -> Processed<BatchWorker<DB, B>>
where
    D: Delivery,
    DB: crate::store::Backend,
    B: BatchBody<DB, T, E>,
    T: Send + 'static,
    E: std::error::Error + Send + 'static,
{
    move |mut worker: BatchWorker<DB, B>, unit: Vec<D>| {
        let (consumer, settler) = (consumer.clone(), settler.clone());
        Box::pin(async move {
            let mut taken = Vec::with_capacity(unit.len());
            let mut keyless = Vec::new();
            for delivery in unit {
                match delivery.message() {
                    Ok(message) => taken.push((delivery, message)),
                    Err(reason) => keyless.push((delivery, reason)),
                }
            }
            let (deliveries, messages): (Vec<D>, Vec<Message>) = taken.into_iter().unzip();
            let span = tracing::info_span!("batch", size = messages.len());
            let outcomes =
                tracing::Instrument::instrument(run_batch(&mut worker, &consumer, &messages), span)
                    .await;
            let policy = &settler.policy;
            let routes: Vec<(Route, bool)> = match &outcomes {
                Ok(outcomes) => outcomes
                    .iter()
                    .zip(&messages)
                    .map(|(outcome, message)| {
                        let duplicate = matches!(outcome, Ok(Handled::Duplicate { .. }));
                        (Route::of(outcome, message.attempt, policy), duplicate)
                    })
                    .collect(),
                Err(error) => {
                    // Every message shares the batch's fate.
                    let reason = describe_inbox(error);
                    tracing::warn!(%reason, "the batch failed as a whole");
                    messages
                        .iter()
                        .map(|message| {
                            let route = Route::failure(
                                error.is_retryable(),
                                &reason,
                                message.attempt,
                                policy,
                            );
                            (route, false)
                        })
                        .collect()
                }
            };
            let settler = &settler;
            let mut settled = Vec::new();
            for (delivery, reason) in keyless {
                let route = Route::DeadLetter {
                    reason,
                    attempts: 1,
                };
                settled.push(Box::pin(settler.settle(delivery, None, route, false))
                    as futures_util::future::BoxFuture<'_, ()>);
            }
            for ((delivery, message), (route, duplicate)) in
                deliveries.into_iter().zip(&messages).zip(routes)
            {
                settled.push(Box::pin(settler.settle(
                    delivery,
                    Some(message),
                    route,
                    duplicate,
                )));
            }
            futures_util::future::join_all(settled).await;
            worker
        })
    }
}

/// Handles `messages` in one transaction with an outcome each, as
/// [`Inbox::handle_batch_each`](crate::Inbox::handle_batch_each) does, with the body a worker of a
/// runner has (whose futures are `Send`, so that batches run on worker tasks).
async fn run_batch<DB, B, T, E>(
    worker: &mut BatchWorker<DB, B>,
    consumer: &str,
    messages: &[Message],
) -> Result<Vec<Result<Handled<T>, Error<E>>>, crate::error::InboxError>
where
    DB: crate::store::Backend,
    B: BatchBody<DB, T, E>,
    E: std::error::Error + 'static,
{
    let keys = messages
        .iter()
        .map(|message| crate::key::message_key(&message.message_id))
        .collect::<Result<Vec<_>, _>>()?;
    let inbox = &worker.inbox;
    let mut batch = inbox.claim_batch(consumer, &keys).await?;
    let mut outcomes = Vec::with_capacity(messages.len());
    for (index, (message, key)) in messages.iter().zip(keys).enumerate() {
        if !batch.is_new(index) {
            outcomes.push(Ok(Handled::Duplicate {
                consumer: consumer.to_owned(),
                key,
                response: None,
            }));
            continue;
        }
        batch.mark(index).await?;
        match worker.body.run(batch.connection(), message).await {
            Ok(value) => outcomes.push(Ok(Handled::Processed(value))),
            Err(error) => {
                batch
                    .undo(index, &inbox.config.statements, consumer, &key)
                    .await?;
                outcomes.push(Err(Error::of_body(error, |e| crate::store::fault_of(e))));
            }
        }
    }
    batch.commit().await?;
    Ok(outcomes)
}

/// Runs one delivery through a worker's handler and settles it by the outcome.
async fn handle<D, W, Fut, T, E>(worker: &mut W, delivery: D, settler: &Settler)
where
    D: Delivery,
    W: FnMut(Message) -> Fut,
    Fut: Future<Output = Result<Handled<T>, Error<E>>>,
    E: fmt::Display,
{
    let message = match delivery.message() {
        Ok(message) => message,
        Err(reason) => {
            tracing::warn!(%reason, "dead-lettering a delivery the handler cannot take");
            let route = Route::DeadLetter {
                reason,
                attempts: 1,
            };
            return settler.settle(delivery, None, route, false).await;
        }
    };
    let attempt = message.attempt;
    let kept = settler.before.is_some().then(|| message.clone());
    let span = tracing::info_span!(
        "delivery",
        message_id = %message.message_id,
        attempt,
        route = tracing::field::Empty,
    );
    let outcome = {
        let call = tracing::Instrument::instrument(worker(message), span.clone());
        tokio::pin!(call);
        let alive = delivery.keep_alive();
        tokio::pin!(alive);
        tokio::select! {
            outcome = &mut call => outcome,
            () = &mut alive => call.await,
        }
    };
    let route = Route::of(&outcome, attempt, &settler.policy);
    let duplicate = matches!(outcome, Ok(Handled::Duplicate { .. }));
    span.record("route", tracing::field::debug(&route));
    match &route {
        Route::Ack => {}
        Route::Retry { attempt, after } => {
            tracing::info!(parent: &span, next_attempt = attempt, ?after, "retrying later")
        }
        Route::DeadLetter { reason, attempts } => {
            tracing::warn!(parent: &span, %reason, attempts, "dead-lettering")
        }
    }
    settler
        .settle(delivery, kept.as_ref(), route, duplicate)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::InboxError;

    #[derive(Debug)]
    struct Oops;

    impl fmt::Display for Oops {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("oops")
        }
    }

    #[test]
    fn outcomes_route_as_the_table_says() {
        let policy = RetryPolicy::new(3, Duration::from_millis(100));
        let processed: Result<Handled<()>, Error<Oops>> = Ok(Handled::Processed(()));
        assert_eq!(Route::of(&processed, 1, &policy), Route::Ack);
        let transient: Result<Handled<()>, Error<Oops>> = Err(Error::Transient(Oops));
        assert_eq!(
            Route::of(&transient, 1, &policy),
            Route::Retry {
                attempt: 2,
                after: Duration::from_millis(100)
            }
        );
        assert_eq!(
            Route::of(&transient, 2, &policy),
            Route::Retry {
                attempt: 3,
                after: Duration::from_millis(200)
            }
        );
        assert!(matches!(
            Route::of(&transient, 3, &policy),
            Route::DeadLetter { attempts: 3, ref reason } if reason.contains("3 attempts") && reason.contains("oops")
        ));
        let failed: Result<Handled<()>, Error<Oops>> = Err(Error::Handler(Oops));
        assert_eq!(
            Route::of(&failed, 1, &policy),
            Route::DeadLetter {
                reason: "oops".into(),
                attempts: 1
            }
        );
        let ended: Result<Handled<()>, Error<Oops>> =
            Err(Error::Inbox(InboxError::TransactionAborted));
        assert!(matches!(Route::of(&ended, 1, &policy), Route::Retry { .. }));
    }

    fn duration() -> impl proptest::strategy::Strategy<Value = Duration> {
        use proptest::prelude::*;
        prop_oneof![
            (any::<u64>(), 0..1_000_000_000u32).prop_map(|(s, n)| Duration::new(s, n)),
            (0..100_000u64).prop_map(Duration::from_millis),
            Just(Duration::ZERO),
            Just(Duration::MAX),
        ]
    }

    fn multiplier() -> impl proptest::strategy::Strategy<Value = f64> {
        use proptest::prelude::*;
        prop_oneof![
            any::<f64>(),
            0.0..10.0f64,
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(f64::NEG_INFINITY),
        ]
    }

    proptest::proptest! {
        /// Issue 21: `RetryPolicy::new(66, 1 s).max_delay(m)` panicked (the delay overflowed
        /// before it was capped). No input panics; delays never shrink and never pass the longest.
        #[test]
        fn no_policy_panics_and_its_delays_never_shrink_nor_pass_the_longest(
            attempts in proptest::prelude::any::<u32>(),
            first in duration(),
            longest in duration(),
            multiplier in multiplier(),
            attempt in proptest::prelude::any::<u32>(),
        ) {
            let policy = RetryPolicy::new(attempts, first).multiplier(multiplier).max_delay(longest);
            let delay = policy.delay_after(attempt);
            proptest::prop_assert!(delay <= longest);
            if let Some(next) = attempt.checked_add(1) {
                proptest::prop_assert!(delay <= policy.delay_after(next));
            }
            if multiplier >= 1.0 && multiplier.is_finite() && attempt <= 1 {
                proptest::prop_assert_eq!(delay, first.min(longest));
            }
            let route = Route::failure(true, "oops", attempt, &policy);
            let retried = matches!(route, Route::Retry { .. });
            proptest::prop_assert_eq!(retried, attempt < policy.max_attempts);
        }
    }

    #[test]
    fn sixty_six_attempts_and_more_have_capped_delays() {
        let longest = Duration::from_secs(60);
        for attempts in [66, 100, 1_000, u32::MAX] {
            let policy = RetryPolicy::new(attempts, Duration::from_secs(1)).max_delay(longest);
            for attempt in [1, 64, 65, 66, 1_000, u32::MAX] {
                assert!(policy.delay_after(attempt) <= longest);
            }
            assert_eq!(policy.delay_after(attempts - 1), longest);
        }
    }

    #[test]
    fn delays_grow_and_stop_at_the_longest() {
        let policy = RetryPolicy::new(10, Duration::from_secs(1)).max_delay(Duration::from_secs(5));
        let delays: Vec<u64> = (1..6).map(|n| policy.delay_after(n).as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 5, 5]);
    }
}
