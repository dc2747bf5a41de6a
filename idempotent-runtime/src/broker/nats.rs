//! The runner for NATS JetStream (with `async-nats`), on a durable pull consumer.
//!
//! ```no_run
//! # use idempotent_runtime as idempotent;
//! use idempotent::broker::nats::Runner;
//! use idempotent::broker::{Message, RetryPolicy};
//! # async fn demo(jetstream: async_nats::jetstream::Context, inbox: idempotent::Inbox<sqlx::Sqlite>) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let stream = jetstream.get_stream("PAYMENTS").await?;
//! let consumer: async_nats::jetstream::consumer::PullConsumer =
//!     stream.get_consumer("ledger").await?;
//! let stats = Runner::new(jetstream, consumer, "PAYMENTS.dead")
//!     .workers(4)
//!     .retry(RetryPolicy::new(5, std::time::Duration::from_secs(1)))
//!     .run(|| {
//!         let inbox = inbox.for_worker();
//!         move |message: Message| {
//!             let inbox = inbox.clone();
//!             async move {
//!                 // decode `message.payload`, call an #[idempotent] handler with `&inbox`
//!                 # let _ = (inbox, message);
//!                 # Ok::<_, idempotent::Error<std::convert::Infallible>>(idempotent::Handled::Processed(()))
//!             }
//!         }
//!     })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! The key is the producer's `Nats-Msg-Id` header; a message without one is dead-lettered.
//!
//! - Acknowledgements wait for the server's confirmation (`double_ack`): the runner knows the ack
//!   landed before it counts the delivery done.
//! - **Retries**: a `nak` with the policy's delay, so JetStream holds the message back that long;
//!   the attempt is JetStream's own delivery count, so a crash redelivery counts too. Give the
//!   consumer a `max_deliver` above the policy's `max_attempts` (or none): JetStream stops
//!   delivering at `max_deliver` on its own, without a dead letter.
//! - **Attempts** are JetStream's own delivery count of this consumer: a producer's header does not
//!   count, and a dead letter published back to the stream on purpose is a new stream message,
//!   which starts again at attempt 1. (Within the stream's duplicate window JetStream drops a
//!   message published again with the same `Nats-Msg-Id`: put dead letters back after it.)
//! - **Dead letters** are published to the subject you name with the headers
//!   `Idempotent-Reason`, `Idempotent-Attempts`, `Idempotent-Subject` and
//!   `Idempotent-Dead-Lettered-At`, and once JetStream stored them the delivery is terminated
//!   (`term`): JetStream will not deliver it again ([`DeadLetterQueue`] reads and puts them
//!   back). A stream must capture that subject: the runner checks at start, and returns
//!   [`BrokerError::DeadLetterTarget`] before it takes a delivery when none does.
//! - **A dead letter that cannot be published** (the stream was deleted since, JetStream did not
//!   confirm it within the [publish timeout](Runner::publish_timeout), 10 s by default) does not
//!   stop the runner: the delivery is `nak`ed with a back-off of its own (1 s, doubling per failure
//!   of that message, at most a minute), and the runner goes on with the others.
//! - **The consumer must acknowledge explicitly** (`AckPolicy::Explicit`, JetStream's default):
//!   with `All`, one acknowledgement settles every earlier message, those other workers still
//!   handle included, and a crash then loses them; with `None` nothing is redelivered. The runner
//!   refuses any other policy at start with [`BrokerError::AckPolicy`].
//! - **Connections**: the NATS client reconnects by itself. While the server is away the runner's
//!   pull requests fail: it says so once at `warn`, tries again after a back-off (100 ms, doubling,
//!   at most 5 s, jittered), says at `info` when messages come again, and counts it
//!   ([`RunnerStats::reconnects`], the `idempotent_runner_reconnects_total` metric); it never ends
//!   for that. Acknowledgements that fail meanwhile leave their messages to be delivered again
//!   after `ack_wait`, which the inbox finds to be duplicates. A deleted consumer or stream ends
//!   the runner with [`BrokerError::Cancelled`].
//! - A handler that runs longer than half the consumer's `ack_wait` sends in-progress acks, so
//!   JetStream does not deliver the message to someone else meanwhile.
//! - The runner pulls at most `workers` messages at a time (batches: `workers` × the batch size),
//!   one pull request at a time. On shutdown it stops pulling, settles
//!   the deliveries in flight, and `nak`s (without delay) those it had pulled but not started.
//!
//! JetStream's own duplicate detection (`Nats-Msg-Id` within the stream's duplicate window) drops
//! a second *publication* of a message; it does nothing for a *redelivery* of one message to a
//! consumer (a crash before the ack, an expired `ack_wait`), which is what the inbox is for.

/// The NATS client this runner was built against: make the runner's context and consumer with it.
pub use async_nats;

mod dead_letters;
mod publisher;
pub use dead_letters::DeadLetterQueue;
pub use publisher::OutboxPublisher;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, AckKind};
use futures_util::StreamExt;

use super::delivery::Delivery;
use super::drive::{DeliveriesAtOnce, drive};
use super::error::BrokerError;
use super::message::{Message, MessageId, Redelivered, StreamSequence};
use super::options::RunnerOptions;
use super::outage::Outage;
use super::route::Route;
use super::stats::RunnerStats;
use crate::markers::DeliveryTag;

/// The header that carries a dead letter's reason.
pub const REASON_HEADER: &str = "Idempotent-Reason";
/// The header that carries the number of attempts a dead letter had.
pub const ATTEMPTS_HEADER: &str = "Idempotent-Attempts";
/// The header that names the subject a dead letter came from.
pub const SUBJECT_HEADER: &str = "Idempotent-Subject";
/// The header that carries when a message was dead-lettered, in milliseconds since the Unix epoch.
pub const DEAD_LETTERED_AT_HEADER: &str = "Idempotent-Dead-Lettered-At";

/// Consumes a durable pull consumer and settles each delivery by its handler's outcome; see the
/// [module docs](self).
pub struct Runner {
    jetstream: jetstream::Context,
    consumer: PullConsumer,
    dead_letters: String,
    options: RunnerOptions,
}

impl fmt::Debug for Runner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runner")
            .field("dead_letters", &self.dead_letters)
            .field("workers", &self.options.workers)
            .field("retry", &self.options.retry)
            .finish_non_exhaustive()
    }
}

impl Runner {
    /// Creates a runner on `consumer`, dead-lettering to `dead_letters` (a subject a stream
    /// captures), with one worker and the default [`RetryPolicy`](super::RetryPolicy).
    pub fn new(
        jetstream: jetstream::Context,
        consumer: PullConsumer,
        dead_letters: impl Into<String>,
    ) -> Self {
        Self {
            jetstream,
            consumer,
            dead_letters: dead_letters.into(),
            options: RunnerOptions::default(),
        }
    }

    super::options::runner_builder! {
        /// Runs `workers` handlers at once (and pulls as many messages at a time).
        workers;
        /// Waits at most `timeout` for JetStream to store a dead letter the runner publishes (default
        /// [`DEFAULT_PUBLISH_TIMEOUT`](super::DEFAULT_PUBLISH_TIMEOUT), 10 s); past it, the delivery
        /// is `nak`ed with a back-off.
        publish_timeout;
        /// Checks the consumer's ack policy and the dead-letter subject, then consumes until the
        /// shutdown token is cancelled (or the consumer is deleted), with a handler from `new_worker`
        /// per worker. Returns what it counted.
        run;
    }

    /// Checks the setup, pulls from the consumer and drives the workers.
    async fn consume<W, P, PF>(
        self,
        workers: Vec<W>,
        take: DeliveriesAtOnce,
        process: P,
    ) -> Result<RunnerStats, BrokerError>
    where
        W: Send + 'static,
        P: FnMut(W, Vec<NatsDelivery>) -> PF,
        PF: Future<Output = W> + Send + 'static,
    {
        let info = self.consumer.cached_info();
        let policy = info.config.ack_policy;
        if policy != jetstream::consumer::AckPolicy::Explicit {
            return Err(BrokerError::AckPolicy {
                found: format!("{policy:?}"),
            });
        }
        let ack_wait = info.config.ack_wait;
        let name = format!("{}/{}", info.stream_name, info.name);
        self.check_dead_letters().await?;
        let context = Arc::new(Context {
            jetstream: self.jetstream.clone(),
            dead_letters: self.dead_letters.clone(),
            // In-progress acks well before JetStream gives up on the delivery.
            progress_every: (ack_wait / 2).max(Duration::from_millis(100)),
            publish_timeout: self.options.publish_timeout,
        });
        let mut pull = Pull {
            client: self.jetstream.client(),
            consumer: self.consumer.clone(),
            size: self.options.workers * take.most,
            current: None,
            outage: Outage::new("nats", name.clone(), None),
        };
        // The connection's losses and returns, said and counted as they happen, whatever the
        // workers are doing.
        let watch = tokio::spawn(watch_connection(
            self.jetstream.client(),
            Outage::new("nats", name, Some(self.options.counters.clone())),
        ));
        let deliveries = futures_util::stream::unfold(&mut pull, |pull| async move {
            let message = pull.next().await;
            Some((message, pull))
        })
        .map(|message| {
            message.map(|message| NatsDelivery {
                message,
                context: context.clone(),
            })
        });
        let driven = drive(
            deliveries,
            self.options.shutdown.clone(),
            workers,
            take,
            process,
        )
        .await;
        watch.abort();
        // Pulled but not started: back to JetStream at once. Only the pull request under way:
        // the runner makes no new one.
        if let Some(mut batch) = pull.current.take() {
            while let Ok(Some(Ok(message))) =
                tokio::time::timeout(Duration::from_millis(50), batch.next()).await
            {
                let _ = message.ack_with(AckKind::Nak(None)).await;
            }
        }
        driven?;
        Ok(self.options.counters.snapshot())
    }

    /// Whether a stream captures the dead-letter subject: [`BrokerError::DeadLetterTarget`] when
    /// none does. A server that does not answer is waited for.
    async fn check_dead_letters(&self) -> Result<(), BrokerError> {
        let target = self.dead_letters.as_str();
        let mut outage = Outage::new("nats", target.to_owned(), None);
        loop {
            let found = tokio::select! {
                found = self.jetstream.stream_by_subject(target) => found,
                () = self.options.shutdown.cancelled() => return Ok(()),
            };
            match found {
                Ok(_) => return Ok(()),
                Err(error) => match uncaptured(target, &error) {
                    Some(refused) => return Err(refused),
                    None => tokio::time::sleep(outage.failed(&error)).await,
                },
            }
        }
    }
}

/// Why no stream captures `subject`, by the error of a lookup of the stream that would
/// ([`BrokerError::DeadLetterTarget`]); `None` when the request itself failed (the server did not
/// answer), which says nothing about the subject.
fn uncaptured(
    subject: &str,
    error: &jetstream::context::GetStreamByNameError,
) -> Option<BrokerError> {
    use jetstream::context::GetStreamByNameErrorKind;
    let reason = match error.kind() {
        GetStreamByNameErrorKind::NotFound => "no stream captures the subject".into(),
        GetStreamByNameErrorKind::InvalidSubject => "it is not a valid subject".into(),
        GetStreamByNameErrorKind::JetStream(error) => error.to_string(),
        GetStreamByNameErrorKind::Request => return None,
    };
    Some(BrokerError::DeadLetterTarget {
        target: subject.to_owned(),
        reason,
    })
}

/// `request`'s answer, or [`BrokerError::Timeout`] for `what` once `after` has passed.
async fn within<T>(
    what: &'static str,
    after: Duration,
    request: impl Future<Output = Result<T, BrokerError>>,
) -> Result<T, BrokerError> {
    tokio::time::timeout(after, request)
        .await
        .unwrap_or(Err(BrokerError::Timeout { what, after }))
}

/// How long a pull request waits on the server for messages before it ends empty-handed.
const PULL_EXPIRES: Duration = Duration::from_secs(5);

/// The runner's pull requests: one at a time, each for up to `size` messages (async-nats's
/// [`consumer.batch()`](PullConsumer::batch)), the next made once the last one ended. Not
/// async-nats's endless `consumer.stream()`: with a handful of messages per request its
/// accounting can miss that a request was answered (when the messages arrive before the client
/// saw its request go out, as on a busy machine) and wait the request's expiry plus 5 s, 35 s by
/// default, before it asks again.
struct Pull {
    client: async_nats::Client,
    consumer: PullConsumer,
    size: usize,
    current: Option<jetstream::consumer::pull::Batch>,
    outage: Outage,
}

impl Pull {
    /// The next message, making pull requests until one brings it; pull requests that fail (the
    /// server is away) are made again after a back-off. An error only when the consumer is gone.
    async fn next(&mut self) -> Result<jetstream::Message, BrokerError> {
        loop {
            if !self.connected() {
                // The pull request under way died with the connection.
                self.current = None;
                let lost = std::io::Error::other("the connection to the NATS server is lost");
                let after = self.outage.failed(&lost);
                tokio::time::sleep(after).await;
                continue;
            }
            if let Some(batch) = self.current.as_mut() {
                let next = tokio::select! {
                    next = batch.next() => next,
                    () = disconnected(&self.client) => continue,
                };
                match next {
                    Some(Ok(message)) => {
                        self.outage.restored();
                        return Ok(message);
                    }
                    Some(Err(error)) => {
                        self.current = None;
                        let after = self.outage.failed(error.as_ref());
                        self.wait(after).await?;
                        continue;
                    }
                    None => self.current = None,
                }
            }
            match self
                .consumer
                .batch()
                .max_messages(self.size)
                .expires(PULL_EXPIRES)
                .messages()
                .await
            {
                Ok(batch) => {
                    self.outage.restored();
                    self.current = Some(batch);
                }
                Err(error) => {
                    let after = self.outage.failed(&error);
                    self.wait(after).await?;
                }
            }
        }
    }

    fn connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    /// After a failed pull: [`BrokerError::Cancelled`] when the consumer or its stream was
    /// deleted, otherwise a wait of `after` before the next pull.
    async fn wait(&mut self, after: Duration) -> Result<(), BrokerError> {
        use jetstream::context::ConsumerInfoErrorKind;
        if let Err(error) = self.consumer.get_info().await
            && matches!(
                error.kind(),
                ConsumerInfoErrorKind::NotFound | ConsumerInfoErrorKind::StreamNotFound
            )
        {
            let info = self.consumer.cached_info();
            return Err(BrokerError::Cancelled {
                source_name: format!("{}/{}", info.stream_name, info.name),
            });
        }
        tokio::time::sleep(after).await;
        Ok(())
    }
}

/// Says when the client loses its connection and when it has it back, and counts the returns
/// (checked every 100 ms; the client itself reconnects).
async fn watch_connection(client: async_nats::Client, mut outage: Outage) {
    let lost = std::io::Error::other("the connection to the NATS server is lost");
    loop {
        if client.connection_state() == async_nats::connection::State::Connected {
            outage.restored();
        } else {
            outage.failed(&lost);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Returns once the client is not connected (checked every 100 ms).
async fn disconnected(client: &async_nats::Client) {
    while client.connection_state() == async_nats::connection::State::Connected {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What every delivery of one runner needs to settle.
struct Context {
    jetstream: jetstream::Context,
    dead_letters: String,
    progress_every: Duration,
    publish_timeout: Duration,
}

struct NatsDelivery {
    message: jetstream::Message,
    context: Arc<Context>,
}

impl Delivery for NatsDelivery {
    const RELEASE_DELAYS: bool = true;

    fn message(&self) -> Result<Message, String> {
        let message_id = self
            .message
            .headers
            .as_ref()
            .and_then(|headers| headers.get(async_nats::header::NATS_MESSAGE_ID))
            .map(|id| id.as_str().to_owned())
            .filter(|id| !id.is_empty())
            .ok_or_else(|| "the message has no Nats-Msg-Id header: it has no key".to_owned())?;
        let info = self
            .message
            .info()
            .map_err(|error| format!("the message has no JetStream metadata: {error}"))?;
        let headers = self
            .message
            .headers
            .iter()
            .flat_map(HeaderMap::iter)
            .filter_map(|(name, values)| {
                let value = values.last()?;
                Some((name.to_string(), value.as_str().to_owned()))
            })
            .collect();
        Ok(Message {
            message_id: MessageId(message_id),
            payload: self.message.payload.to_vec(),
            headers,
            attempt: u32::try_from(info.delivered).unwrap_or(1).max(1),
            delivery_tag: DeliveryTag(info.consumer_sequence),
            redelivered: Redelivered(info.delivered > 1),
            stream_sequence: Some(StreamSequence(info.stream_sequence)),
        })
    }

    async fn settle(&self, route: &Route) -> Result<(), BrokerError> {
        match route {
            Route::Ack => self.message.double_ack().await.map_err(BrokerError::Broker),
            Route::Retry { after, .. } => self
                .message
                .ack_with(AckKind::Nak(Some(*after)))
                .await
                .map_err(BrokerError::Broker),
            Route::DeadLetter { reason, attempts } => {
                let mut headers = self.message.headers.clone().unwrap_or_default();
                headers.insert(REASON_HEADER, reason.as_str());
                headers.insert(ATTEMPTS_HEADER, attempts.to_string().as_str());
                headers.insert(SUBJECT_HEADER, self.message.subject.as_str());
                headers.insert(DEAD_LETTERED_AT_HEADER, now_ms().to_string().as_str());
                let stored = async {
                    self.context
                        .jetstream
                        .publish_with_headers(
                            self.context.dead_letters.clone(),
                            headers,
                            self.message.payload.clone(),
                        )
                        .await
                        .map_err(BrokerError::broker)?
                        .await
                        .map_err(BrokerError::broker)
                };
                within("dead letter", self.context.publish_timeout, stored).await?;
                self.message
                    .ack_with(AckKind::Term)
                    .await
                    .map_err(BrokerError::Broker)
            }
        }
    }

    async fn release(self, after: Duration) {
        let _ = self.message.ack_with(AckKind::Nak(Some(after))).await;
    }

    async fn keep_alive(&self) {
        loop {
            tokio::time::sleep(self.context.progress_every).await;
            let _ = self.message.ack_with(AckKind::Progress).await;
        }
    }
}

/// Milliseconds since the Unix epoch, now.
fn now_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis()
}
