//! The runner for Kafka (with `rdkafka`): topics consumed in a consumer group, offsets committed
//! after each record's outcome.
//!
//! ```no_run
//! # use idempotent_runtime as idempotent;
//! use idempotent::broker::kafka::{ClientConfig, Runner};
//! use idempotent::broker::{Message, RetryPolicy};
//! # async fn demo(inbox: idempotent::Inbox<sqlx::Sqlite>) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let mut client = ClientConfig::new();
//! client.set("bootstrap.servers", "localhost:9092");
//! let stats = Runner::new(client, "ledger", &["payments"], "payments.dead")
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
//! The key is the producer's id in the record's [`MESSAGE_ID_HEADER`] header (`message-id`; another
//! with [`Runner::message_id_header`]), never topic, partition and offset: a record produced twice
//! (a producer's retry without idempotence, a dead letter put back) has a new offset. A record
//! without one is dead-lettered.
//!
//! - **Offsets** are committed only after a record's outcome, and per partition in order: the
//!   runner stores a partition's offset past its lowest unfinished record, and the consumer commits
//!   what is stored (every `auto.commit.interval.ms`, on a rebalance and at shutdown). A crash
//!   between the database's commit and the offset's delivers the record again, and the inbox says
//!   it is a duplicate.
//! - **Order**: a partition's records go to one worker at a time, in offset order (`workers` run
//!   different partitions at once): the records of a partition that succeed take effect in their
//!   order. In batch mode a batch takes as many records of a partition as it has room for, in
//!   order, and the other workers' batches take other partitions until they are settled.
//! - **Retries** do not block their partition: a retryable failure with attempts left is produced
//!   to a retry topic, `<group>.retry.<delay>ms` (one per delay of the policy; another prefix with
//!   [`Runner::retry_topics`]), with the attempt in [`ATTEMPT_HEADER`] and the time it is due in
//!   [`DUE_HEADER`], and its offset committed; the runner consumes its retry topics too, and hands a
//!   retry to a worker once it is due. The attempt is the runner's own header, read on its retry
//!   topics only: a producer cannot set it.
//! - **Holding a partition instead** ([`Runner::hold_partition_on_failure`], opt-in): retries wait
//!   in place and a record that would be dead-lettered is parked, holding back the rest of its
//!   partition until an operator retries or skips it ([`HeldPartitions`]).
//! - **Dead letters** (a failure that is not retryable, a retryable one on its last attempt, a
//!   record with no key) are produced to the dead-letter topic with [`REASON_HEADER`],
//!   [`ATTEMPTS_HEADER`], [`TOPIC_HEADER`], [`PARTITION_HEADER`] and [`OFFSET_HEADER`], keeping the
//!   record's key and headers, and then its offset is committed.
//! - **Topics**: at start the runner makes its retry topics and the dead-letter topic where they
//!   are missing (as many partitions as its largest topic; `CreateTopics`, or the broker's
//!   auto-creation), and returns [`BrokerError::DeadLetterTarget`] when the dead-letter topic cannot
//!   be made, before it consumes anything.
//! - **A retry or dead letter that cannot be produced** (refused, not acknowledged within the
//!   [publish timeout](Runner::publish_timeout)) does not stop the runner, and does not skip the
//!   record: it is tried again after a back-off of its own (1 s, doubling, at most a minute),
//!   holding back the rest of its partition meanwhile, while the other partitions go on.
//! - **Rebalances**: a revoked partition's records not yet started are dropped, and those in
//!   flight finish without committing: the partition's new owner delivers them again from the
//!   committed offset, and the inbox drops those already done. What was stored is committed on the
//!   revocation.
//! - **Connections**: the Kafka client reconnects by itself; the runner says once at `warn` that
//!   the broker is away, at `info` when it is back, counts it ([`RunnerStats::reconnects`], the
//!   `idempotent_runner_reconnects_total` metric), and never ends for it.
//! - **Shutdown**: the runner stops taking records, settles those in flight, commits what is done
//!   and leaves the group.
//! - **Memory**: the runner holds a partition's fetched records until a worker is free for them,
//!   and pauses fetching it above 1,000 records or 4 MiB (resumed at half).
//!
//! The consumer is configured from the [`ClientConfig`] you give (connection, security, and any
//! consumer setting) with the group, `enable.auto.commit=true` and `enable.auto.offset.store=false`
//! (the runner stores offsets), `auto.offset.reset=earliest` unless you set it (a new group
//! starts at the beginning rather than skipping what was produced before it), and
//! `fetch.wait.max.ms=100` unless you set it: a partition whose fetching resumed waits for the
//! broker's fetch under way, which at librdkafka's 500 ms held a backlog of eight partitions to
//! 1,700 records a second. Its producer (retries and dead letters) gets `acks=all` and
//! `enable.idempotence=true`.

/// The Kafka client this runner was built against: configure the runner's client with it.
pub use rdkafka;
pub use rdkafka::ClientConfig;

mod context;
mod dead_letters;
mod delivery;
mod holds;
mod partitions;
mod publisher;
mod reading;
mod topics;

pub use dead_letters::DeadLetterQueue;
pub use holds::{Asked, COMMAND_HEADER, HOLD_HEADER, HeldPartition, HeldPartitions, holds_topic};
pub use publisher::OutboxPublisher;

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rdkafka::consumer::{CommitMode, Consumer as _, StreamConsumer};
use rdkafka::producer::{FutureProducer, Producer as _};
use rdkafka::{Message as _, TopicPartitionList};
use tokio::sync::Notify;

use super::drive::{DeliveriesAtOnce, drive};
use super::error::BrokerError;
use super::options::RunnerOptions;
use super::outage::Outage;
use super::stats::RunnerStats;
use context::RunnerContext;
use delivery::{KafkaDelivery, Settling};
use partitions::{Fetching, HeldLimit, Partitions, TopicPartition};
use topics::RetryTopics;

/// The header that carries a record's message id, by default: the key.
pub const MESSAGE_ID_HEADER: &str = "message-id";
/// The header, on the runner's retry topics, that carries the attempt a retry is.
pub const ATTEMPT_HEADER: &str = "idempotent-attempt";
/// The header, on the runner's retry topics, that carries when a retry is due (milliseconds since
/// the Unix epoch).
pub const DUE_HEADER: &str = "idempotent-due";
/// The header that carries a dead letter's reason.
pub const REASON_HEADER: &str = "idempotent-reason";
/// The header that carries the number of attempts a dead letter had.
pub const ATTEMPTS_HEADER: &str = "idempotent-attempts";
/// The header that names the topic a retry or dead letter came from.
pub const TOPIC_HEADER: &str = "idempotent-topic";
/// The header that carries the partition a dead letter was consumed from.
pub const PARTITION_HEADER: &str = "idempotent-partition";
/// The header that carries the offset a dead letter was consumed from.
pub const OFFSET_HEADER: &str = "idempotent-offset";

/// Consumes topics in a consumer group and settles each record by its handler's outcome; see the
/// [module docs](self).
pub struct Runner {
    client: ClientConfig,
    group: String,
    topics: Vec<String>,
    dead_letters: String,
    retry_prefix: Option<String>,
    message_id_header: String,
    hold_on_failure: bool,
    options: RunnerOptions,
}

impl fmt::Debug for Runner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runner")
            .field("group", &self.group)
            .field("topics", &self.topics)
            .field("dead_letters", &self.dead_letters)
            .field("workers", &self.options.workers)
            .field("retry", &self.options.retry)
            .finish_non_exhaustive()
    }
}

impl Runner {
    /// Creates a runner that consumes `topics` in consumer group `group` with the client settings
    /// of `client` (`bootstrap.servers` at least), dead-lettering to the topic `dead_letters`,
    /// with one worker and the default [`RetryPolicy`](super::RetryPolicy).
    pub fn new(
        client: ClientConfig,
        group: impl Into<String>,
        topics: &[&str],
        dead_letters: impl Into<String>,
    ) -> Self {
        Self {
            client,
            group: group.into(),
            topics: topics.iter().map(|topic| (*topic).to_owned()).collect(),
            dead_letters: dead_letters.into(),
            retry_prefix: None,
            message_id_header: MESSAGE_ID_HEADER.to_owned(),
            hold_on_failure: false,
            options: RunnerOptions::default(),
        }
    }

    /// Names the retry topics `<prefix>.<delay>ms` (default prefix: `<group>.retry`).
    pub fn retry_topics(mut self, prefix: impl Into<String>) -> Self {
        self.retry_prefix = Some(prefix.into());
        self
    }

    /// Takes the message id, the key, from header `name` (default [`MESSAGE_ID_HEADER`]).
    pub fn message_id_header(mut self, name: impl Into<String>) -> Self {
        self.message_id_header = name.into();
        self
    }

    /// Keeps each partition in order through failures: a record that fails holds back the rest of
    /// its partition (the other partitions go on) until it succeeds, or an operator skips it.
    ///
    /// - Retries wait in place, for the policy's delay (no retry topics: the partition waits).
    /// - A record that would be dead-lettered (a failure that is not retryable, the last attempt,
    ///   no key) is parked instead: its offset is not committed, nothing after it in its
    ///   partition is handed out, and the runner announces the hold on the group's holds topic,
    ///   `<group>.holds` (one partition, compacted, made at start), counted in
    ///   [`RunnerStats::held`].
    /// - An operator lists the holds and retries or skips each with [`HeldPartitions`] (the
    ///   `idempotent kafka held | retry | skip` command): a retry runs the record again now, as
    ///   its next attempt (held again if it fails again); a skip dead-letters it with the
    ///   operator's reason and the partition goes on. The runner follows the holds topic and acts
    ///   within moments.
    /// - A held partition stays held across restarts and rebalances: its committed offset is the
    ///   parked record's, so whoever consumes it next runs that record again, and holds it again
    ///   if it fails (a new hold); a skip asked while no runner held it is done when the record
    ///   fails again.
    /// - Batches take one record per partition (a batch's records of one partition could
    ///   otherwise succeed after an earlier one failed).
    ///
    /// Records of one key keep their order only as far as they share a partition: hold
    /// partitions when your producers key by what must stay in order.
    pub fn hold_partition_on_failure(mut self) -> Self {
        self.hold_on_failure = true;
        self
    }

    super::options::runner_builder! {
        /// Runs `workers` handlers at once, each on a different partition.
        workers;
        /// Waits at most `timeout` for the broker to acknowledge a retry or dead letter the runner
        /// produces (default [`DEFAULT_PUBLISH_TIMEOUT`](super::DEFAULT_PUBLISH_TIMEOUT), 10 s); past
        /// it, the record is tried again after a back-off.
        publish_timeout;
        /// Makes the runner's topics where they are missing, then consumes until the shutdown token is
        /// cancelled, with a handler from `new_worker` per worker. Returns what it counted.
        run;
    }

    /// Makes the topics, subscribes and drives the workers; commits and leaves at the end.
    async fn consume<W, P, PF>(
        self,
        workers: Vec<W>,
        take: DeliveriesAtOnce,
        mut process: P,
    ) -> Result<RunnerStats, BrokerError>
    where
        W: Send + 'static,
        P: FnMut(W, Vec<KafkaDelivery>) -> PF,
        PF: Future<Output = W> + Send + 'static,
    {
        let shutdown = self.options.shutdown.clone();
        // Holding partitions, retries wait in place: no retry topics.
        let retry = if self.hold_on_failure {
            RetryTopics::default()
        } else {
            RetryTopics::new(
                self.retry_prefix
                    .clone()
                    .unwrap_or_else(|| format!("{}.retry", self.group)),
                &self.options.retry,
            )
        };
        let producer: FutureProducer = producer_config(&self.client, self.options.publish_timeout)
            .create()
            .map_err(BrokerError::broker)?;
        topics::ensure(
            &self.client,
            &producer,
            &self.topics,
            retry.names(),
            &self.dead_letters,
            &shutdown,
        )
        .await?;
        if shutdown.is_cancelled() {
            return Ok(self.options.counters.snapshot());
        }
        let holds = if self.hold_on_failure {
            let holds = holds::Holds::start(&self.client, &producer, &self.group).await?;
            Some(Arc::new(holds))
        } else {
            None
        };
        // Holding partitions, a unit takes one record of each: a later record of a batch must not
        // succeed when an earlier one failed.
        let per_unit = if holds.is_some() { 1 } else { take.most };
        let partitions = Arc::new(Mutex::new(Partitions::new(
            per_unit,
            HeldLimit {
                records: (take.most * 2).max(PAUSE_ABOVE),
                bytes: PAUSE_ABOVE_BYTES,
            },
        )));
        let wake = Arc::new(Notify::new());
        let context = RunnerContext {
            partitions: partitions.clone(),
            wake: wake.clone(),
            outage: Mutex::new(Outage::new(
                "kafka",
                self.group.clone(),
                Some(self.options.counters.clone()),
            )),
        };
        let consumer: StreamConsumer<RunnerContext> = self
            .consumer_config()
            .create_with_context(context)
            .map_err(BrokerError::broker)?;
        let subscribed: Vec<&str> = self
            .topics
            .iter()
            .chain(retry.names())
            .map(String::as_str)
            .collect();
        consumer
            .subscribe(&subscribed)
            .map_err(BrokerError::broker)?;
        let settling = Arc::new(Settling {
            consumer: Arc::new(consumer),
            partitions,
            wake,
            producer: producer.clone(),
            retry,
            dead_letters: self.dead_letters.clone(),
            message_id_header: self.message_id_header.clone(),
            publish_timeout: self.options.publish_timeout,
            counters: self.options.counters.clone(),
            holds: holds.clone(),
        });
        let following =
            holds.map(|holds| tokio::spawn(holds.follow(settling.clone(), shutdown.child_token())));
        let fetch = Fetch {
            settling: settling.clone(),
            missing: Default::default(),
        };
        let deliveries = futures_util::stream::unfold(fetch, |mut fetch| async move {
            let delivery = fetch.next().await;
            Some((delivery, fetch))
        });
        // A unit is closed when it goes to its worker: the next takes other partitions until its
        // records settle.
        let closing = settling.clone();
        let process = move |worker, unit| {
            closing.partitions().close_unit();
            process(worker, unit)
        };
        let driven = drive(deliveries, shutdown.clone(), workers, take, process).await;
        if let Some(following) = following {
            following.abort();
            let _ = following.await;
        }
        // What was fetched and not started is fetched again by whoever consumes next; what is done
        // is committed, and the consumer leaves its group.
        settling.partitions().clear();
        let consumer = settling.consumer.clone();
        drop(settling);
        let left = tokio::task::spawn_blocking(move || {
            if let Err(error) = consumer.commit_consumer_state(CommitMode::Sync) {
                tracing::debug!(%error, "no offsets committed at shutdown");
            }
            drop(consumer);
            let _ = producer.flush(Duration::from_secs(5));
        });
        let _ = left.await;
        driven?;
        Ok(self.options.counters.snapshot())
    }

    fn consumer_config(&self) -> ClientConfig {
        let mut config = self.client.clone();
        config
            .set("group.id", &self.group)
            .set("enable.auto.commit", "true")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false");
        if config.get("auto.offset.reset").is_none() {
            config.set("auto.offset.reset", "earliest");
        }
        // A partition whose fetching resumed joins the broker's next fetch, which waits for the
        // one under way: at librdkafka's 500 ms, a backlog of eight partitions ran at 1,700
        // records a second whatever the handler's speed.
        if config.get("fetch.wait.max.ms").is_none() {
            config.set("fetch.wait.max.ms", FETCH_WAIT_MAX_MS);
        }
        config
    }
}

/// The settings of every producer of this module (the runner's retries and dead letters, the
/// outbox's publisher): `client`'s, with `acks=all`, the idempotent producer, and a delivery
/// timeout of `timeout`.
fn producer_config(client: &ClientConfig, timeout: Duration) -> ClientConfig {
    let mut config = client.clone();
    config
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set("message.timeout.ms", timeout.as_millis().max(1).to_string());
    config
}

/// Produces `record` with `producer` and waits, at most `after`, for the broker to have it
/// (`acks=all`); a record the broker refuses (its topic, its size, its rights) is `refusal`'s error.
async fn produce(
    producer: &FutureProducer,
    record: rdkafka::producer::FutureRecord<'_, [u8], [u8]>,
    what: &'static str,
    after: Duration,
    refusal: impl FnOnce(&rdkafka::error::KafkaError) -> BrokerError,
) -> Result<(), BrokerError> {
    use rdkafka::types::RDKafkaErrorCode;
    match tokio::time::timeout(after, producer.send(record, after)).await {
        Err(_) => Err(BrokerError::Timeout { what, after }),
        Ok(Ok(_)) => Ok(()),
        Ok(Err((error, _))) if refused(&error) => Err(refusal(&error)),
        Ok(Err((error, _))) => Err(
            if error.rdkafka_error_code() == Some(RDKafkaErrorCode::MessageTimedOut) {
                BrokerError::Timeout { what, after }
            } else {
                BrokerError::broker(error)
            },
        ),
    }
}

/// Whether a producer's error is the broker refusing the record (its topic, its size, its
/// rights), not the broker being away.
fn refused(error: &rdkafka::error::KafkaError) -> bool {
    use rdkafka::types::RDKafkaErrorCode;
    matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::UnknownTopicOrPartition
                | RDKafkaErrorCode::UnknownTopic
                | RDKafkaErrorCode::TopicAuthorizationFailed
                | RDKafkaErrorCode::InvalidTopic
                | RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::InvalidRecord
        )
    )
}

/// Records held per partition above which its fetching pauses: a partition paused and resumed
/// waits for its next fetch (up to `fetch.wait.max.ms` when the broker has nothing new for the
/// others), so the limit is high enough that a backlog rarely meets it.
const PAUSE_ABOVE: usize = 1000;
/// The consumer's `fetch.wait.max.ms` unless the client settings have one (librdkafka's: 500).
const FETCH_WAIT_MAX_MS: &str = "100";
/// Bytes held per partition (keys, payloads and headers) above which its fetching pauses.
const PAUSE_ABOVE_BYTES: usize = 4 << 20;

/// The records for the workers: fetched from the consumer into [`Partitions`], handed out as they
/// come due and their partitions are free.
struct Fetch {
    settling: Arc<Settling>,
    /// Topics the broker said it does not have, said once each.
    missing: std::collections::HashSet<String>,
}

impl Fetch {
    /// The next record a worker may take. An error only when the client failed for good.
    async fn next(&mut self) -> Result<KafkaDelivery, BrokerError> {
        let mut backoff =
            super::backoff::Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        loop {
            let (lease, change, wake_at) = {
                let mut partitions = self.settling.partitions();
                let now = tokio::time::Instant::now();
                match partitions.next_due(now) {
                    Some((lease, change)) => (Some(lease), change, None),
                    None => (None, None, partitions.next_wake()),
                }
            };
            self.apply(change);
            if let Some(lease) = lease {
                return Ok(KafkaDelivery::new(lease, self.settling.clone()));
            }
            let consumer = self.settling.consumer.clone();
            let received = tokio::select! {
                biased;
                () = self.settling.wake.notified() => continue,
                () = sleep_until(wake_at) => continue,
                received = consumer.recv() => received.map(|record| record.detach()),
            };
            match received {
                Ok(record) => {
                    backoff.reset();
                    consumer.context().restored();
                    self.fetched(record);
                }
                Err(error) => {
                    if let Some((code, reason)) = consumer.client().fatal_error() {
                        return Err(BrokerError::broker(std::io::Error::other(format!(
                            "the Kafka client failed for good: {code}: {reason}"
                        ))));
                    }
                    self.failed(&error);
                    tokio::time::sleep(backoff.next()).await;
                }
            }
        }
    }

    fn fetched(&mut self, record: rdkafka::message::OwnedMessage) {
        let partition = TopicPartition {
            topic: record.topic().into(),
            partition: record.partition(),
        };
        let due = if self.settling.retry.contains(record.topic()) {
            due_at(&record)
        } else {
            None
        };
        let change = self.settling.partitions().fetched(partition, record, due);
        self.apply(change);
    }

    /// Says what went wrong: a missing topic once each, the broker's trouble as an outage.
    fn failed(&mut self, error: &rdkafka::error::KafkaError) {
        use rdkafka::types::RDKafkaErrorCode;
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::UnknownTopicOrPartition) {
            let said = error.to_string();
            if self.missing.insert(said.clone()) {
                tracing::warn!(error = said, "a topic the runner consumes is missing");
            }
        } else {
            self.settling.consumer.context().failed(error);
        }
    }

    /// Pauses or resumes fetching a partition.
    fn apply(&self, change: Option<Fetching>) {
        let Some(change) = change else { return };
        let mut list = TopicPartitionList::new();
        let (partition, paused) = match &change {
            Fetching::Pause(partition) => (partition, true),
            Fetching::Resume(partition) => (partition, false),
        };
        list.add_partition(&partition.topic, partition.partition);
        let consumer = &self.settling.consumer;
        let done = if paused {
            consumer.pause(&list)
        } else {
            consumer.resume(&list)
        };
        if let Err(error) = done {
            tracing::debug!(%error, ?change, "could not pause or resume a partition");
        }
    }
}

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// When a retry is due, from its [`DUE_HEADER`]; `None` (now) without one.
fn due_at(record: &rdkafka::message::OwnedMessage) -> Option<tokio::time::Instant> {
    let due: u64 = delivery::header(record, DUE_HEADER)?.parse().ok()?;
    let now = SystemTime::now().duration_since(UNIX_EPOCH).ok()?;
    let wait = Duration::from_millis(due).saturating_sub(now);
    // A clock far off (or a header forged far into the future) waits no longer than an hour.
    Some(tokio::time::Instant::now() + wait.min(Duration::from_secs(3600)))
}
