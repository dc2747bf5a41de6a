//! The relay: takes committed outgoing messages from the outbox table, publishes them through a
//! [`Publisher`], and marks them sent once the broker confirmed them.
//!
//! One batch is one transaction: the relay takes up to `batch_size` due rows that no other relay
//! holds (PostgreSQL, MySQL and MariaDB: `SELECT … FOR UPDATE SKIP LOCKED`; SQLite: the batch's
//! `BEGIN IMMEDIATE` holds the database's one write lock), publishes them concurrently, waits for
//! every confirmation, marks the confirmed rows sent and records the failures, and commits. A relay
//! that dies anywhere in between (after the broker's confirmation too) leaves its rows pending, and
//! the next batch publishes them again: at least once, never marked sent unconfirmed.
//!
//! A batch takes several consecutive rows of an ordering key (its head and those after it, in the
//! key's order). Those it publishes one after another, each once the broker confirmed the one
//! before, while other keys and rows without a key go on beside them; the first that fails stops
//! its key, and the key's rows after it stay pending, untried ([`RelayReport::held_back`]), so a
//! later message of a key never reaches the broker before an earlier one. The workers of one relay
//! take different keys ([`KeyShare`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use super::publisher::{Publication, PublishError, Publisher};
use crate::clock::millis;
use crate::error::{InboxError, Stage};
use crate::inbox::outgoing::{Destination, decode_headers};
use crate::inbox::{Inbox, commit};
use crate::metrics::OutboxMetrics;
use crate::session::Session;
use crate::store::{
    Backend, Failure, KeyShare, PARKED, PENDING, ParkedRows, TakenRow, database_error,
};
use crate::transaction::{BeginError, InboxTransaction};

/// How a relay works; see [`Inbox::spawn_relay`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RelayOptions {
    /// The most rows one batch (one transaction) takes (default 100).
    pub batch_size: usize,
    /// Attempts a message gets before it is parked, counting only the broker's refusals
    /// ([`PublishError::Rejected`]; default 10).
    pub max_attempts: u32,
    /// The delay before a refused message's second attempt (default 1 s); each later one doubles,
    /// up to `max_retry_delay`.
    pub first_retry_delay: Duration,
    /// The longest delay between two attempts of a refused message (default 5 minutes).
    pub max_retry_delay: Duration,
    /// How soon an idle relay looks again (default 10 ms); each empty look doubles the wait, up to
    /// `max_poll_interval`, and work found brings it back here.
    pub min_poll_interval: Duration,
    /// The longest wait of an idle relay between two looks (default 1 s). With `LISTEN` it is the
    /// fallback that finds what a lost notification did not announce.
    pub max_poll_interval: Duration,
    /// How long the relay waits for the broker to confirm one message (default 10 s), connecting
    /// and checking its destination included: every publication has this bound, so a broker that
    /// blocks publishers (a resource alarm) or never answers holds a batch this long at most. An
    /// unconfirmed message stays pending and is published again later.
    pub publish_timeout: Duration,
    /// Batches run at once, each on a connection of its own (default 1).
    pub workers: usize,
    /// On PostgreSQL, wake up when a transaction that wrote outgoing messages commits (`LISTEN`;
    /// default on), rather than only poll. The other databases only poll, and so does an inbox
    /// [`with_transaction_pooling`](crate::Inbox::with_transaction_pooling): a pooler in
    /// transaction mode hands the listening session to other clients between transactions.
    pub listen: bool,
    /// How often the relay counts the backlog for the metrics (default 5 s).
    pub backlog_every: Duration,
    /// Whether a parked message holds its ordering key (default off): the key's later messages
    /// wait until an operator [retries](crate::Inbox::retry_parked) or
    /// [skips](crate::Inbox::skip_parked) it, while other keys go on. Off, the key moves on to its
    /// next message. Set it the same on every relay of the outbox: a relay without it publishes
    /// the messages the others hold back. See [`RelayOptions::parked_holds_key`].
    pub parked_holds_key: bool,
}

impl Default for RelayOptions {
    fn default() -> Self {
        Self {
            batch_size: 100,
            max_attempts: 10,
            first_retry_delay: Duration::from_secs(1),
            max_retry_delay: Duration::from_secs(300),
            min_poll_interval: Duration::from_millis(10),
            max_poll_interval: Duration::from_secs(1),
            publish_timeout: Duration::from_secs(10),
            workers: 1,
            listen: true,
            backlog_every: Duration::from_secs(5),
            parked_holds_key: false,
        }
    }
}

impl RelayOptions {
    /// Returns these options with batches of at most `batch_size` rows.
    pub fn batch_size(self, batch_size: usize) -> Self {
        Self {
            batch_size: batch_size.max(1),
            ..self
        }
    }

    /// Returns these options with `workers` batches at once.
    pub fn workers(self, workers: usize) -> Self {
        Self {
            workers: workers.max(1),
            ..self
        }
    }

    /// Returns these options parking a message after `max_attempts` refusals, the second attempt
    /// `first_retry_delay` after the first.
    pub fn attempts(self, max_attempts: u32, first_retry_delay: Duration) -> Self {
        Self {
            max_attempts: max_attempts.max(1),
            first_retry_delay,
            ..self
        }
    }

    /// Returns these options polling between `min` and `max` when idle.
    pub fn poll_interval(self, min: Duration, max: Duration) -> Self {
        Self {
            min_poll_interval: min,
            max_poll_interval: max.max(min),
            ..self
        }
    }

    /// Returns these options with (or without) PostgreSQL's `LISTEN`.
    pub fn listen(self, listen: bool) -> Self {
        Self { listen, ..self }
    }

    /// Returns these options waiting at most `timeout` for each confirmation.
    pub fn publish_timeout(self, timeout: Duration) -> Self {
        Self {
            publish_timeout: timeout,
            ..self
        }
    }

    /// Returns these options with a parked message holding its ordering key (`true`), or letting
    /// the key's later messages go out (`false`, the default).
    ///
    /// Holding, a message the broker refused `max_attempts` times stays its key's next message:
    /// the key's later messages are not published (other keys go on) until an operator
    /// [retries](crate::Inbox::retry_parked) it, which publishes it before them, or
    /// [skips](crate::Inbox::skip_parked) it, which gives it up and lets them go.
    /// [`Inbox::held_keys`](crate::Inbox::held_keys) (`idempotent outbox held`) lists the keys held
    /// so. Messages without an ordering key are not affected.
    ///
    /// Set it on **every relay of the outbox** (every instance, and every relay each runs): a
    /// relay without it takes a held key's next message, as it would without the option anywhere.
    pub fn parked_holds_key(self, holds: bool) -> Self {
        Self {
            parked_holds_key: holds,
            ..self
        }
    }

    /// What parked rows do to their keys under these options.
    fn parked_rows(&self) -> ParkedRows {
        if self.parked_holds_key {
            ParkedRows::HoldTheKey
        } else {
            ParkedRows::LetTheKeyGo
        }
    }

    /// The delay after a message's `attempt`-th refusal.
    fn retry_delay(&self, attempt: u32) -> Duration {
        let factor = 2f64.powi(attempt.saturating_sub(1).min(30) as i32);
        self.first_retry_delay
            .mul_f64(factor)
            .min(self.max_retry_delay)
    }
}

/// What one batch did: see [`Inbox::relay_once`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayReport {
    /// Rows the batch took.
    pub taken: usize,
    /// Rows the broker confirmed and the batch marked sent.
    pub published: usize,
    /// Rows the broker refused, each to be tried again after a back-off of its own.
    pub rejected: usize,
    /// Rows the broker refused for the last time: parked.
    pub parked: usize,
    /// Rows the broker did not confirm (unreachable, blocking publishers, no answer in time):
    /// left pending, with no attempt counted.
    pub unavailable: usize,
    /// Rows not published because an earlier message of their ordering key, in the same batch,
    /// failed: left pending as they were, untried, for a later batch to publish after it.
    pub held_back: usize,
}

/// What a relay counted since it started: see [`Relay::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayStats {
    /// Batches committed.
    pub batches: u64,
    /// Messages published and marked sent.
    pub published: u64,
    /// Failed publications to be tried again (refused, or not confirmed).
    pub retried: u64,
    /// Messages parked.
    pub parked: u64,
    /// Batches that failed on the database (rolled back, tried again after a pause).
    pub failed_batches: u64,
}

#[derive(Debug, Default)]
struct Counters {
    batches: AtomicU64,
    published: AtomicU64,
    retried: AtomicU64,
    parked: AtomicU64,
    failed_batches: AtomicU64,
}

impl Counters {
    fn count(&self, report: &RelayReport) {
        let add = |counter: &AtomicU64, n: usize| counter.fetch_add(n as u64, Ordering::Relaxed);
        add(&self.batches, 1);
        add(&self.published, report.published);
        add(&self.retried, report.rejected + report.unavailable);
        add(&self.parked, report.parked);
    }

    fn snapshot(&self) -> RelayStats {
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        RelayStats {
            batches: get(&self.batches),
            published: get(&self.published),
            retried: get(&self.retried),
            parked: get(&self.parked),
            failed_batches: get(&self.failed_batches),
        }
    }
}

/// A running relay: its workers publish until it is [shut down](Relay::shutdown), stopped or
/// dropped.
#[derive(Debug)]
#[must_use = "the relay stops when dropped: keep it for as long as it should run, or detach it"]
pub struct Relay {
    stop: watch::Sender<bool>,
    workers: Vec<JoinHandle<()>>,
    listeners: Vec<JoinHandle<()>>,
    counters: Arc<Counters>,
}

impl Relay {
    /// Returns what it counted so far.
    pub fn stats(&self) -> RelayStats {
        self.counters.snapshot()
    }

    /// Stops taking batches, lets the batches in flight finish (their confirmed rows are marked
    /// sent), and returns what the relay counted.
    pub async fn shutdown(mut self) -> RelayStats {
        let _ = self.stop.send(true);
        for worker in std::mem::take(&mut self.workers) {
            let _ = worker.await;
        }
        self.counters.snapshot()
    }

    /// Stops at once: a batch in flight is rolled back (its connection closed), and its rows are
    /// published again by the next relay, even those the broker had confirmed.
    pub fn stop(self) {
        drop(self);
    }

    /// Lets the relay run until the runtime shuts down, with nothing left to stop it.
    pub fn detach(self) {
        std::mem::forget(self);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        for worker in &self.workers {
            worker.abort();
        }
        for listener in &self.listeners {
            listener.abort();
        }
    }
}

/// Starts a relay of the outboxes of `inboxes` (one, or a [`Tenants`](crate::Tenants)' every
/// tenant's); see [`Inbox::spawn_relay`]. Each worker goes round the inboxes, one batch of each
/// per round, starting each round one inbox further: an inbox with a backlog gets one batch a
/// round like the others, so it delays them by a batch each, not by its backlog.
pub(crate) fn spawn<DB: Backend, P: Publisher>(
    inboxes: &[Inbox<DB>],
    publisher: P,
    options: RelayOptions,
) -> Relay {
    let publisher = Arc::new(publisher);
    let options = Arc::new(options);
    let counters = Arc::<Counters>::default();
    let (stop, stopped) = watch::channel(false);
    let wakes: Vec<Arc<Notify>> = (0..options.workers.max(1))
        .map(|_| Arc::new(Notify::new()))
        .collect();
    let wake: Arc<dyn Fn() + Send + Sync> = {
        let wakes = wakes.clone();
        Arc::new(move || {
            for wake in &wakes {
                wake.notify_one();
            }
        })
    };
    // One listener for each database and channel: the inboxes in schemas of one database share
    // theirs.
    let mut heard: Vec<(String, &str)> = Vec::new();
    let mut listeners = Vec::new();
    for inbox in inboxes {
        let statements = &inbox.config.statements.outbox;
        let place = (DB::listen_scope(inbox.pool()), &*statements.channel);
        if !options.listen || statements.pooled || heard.contains(&place) {
            continue;
        }
        heard.push(place);
        listeners.extend(DB::listen_outbox(
            inbox.pool(),
            &statements.channel,
            wake.clone(),
        ));
    }
    let outboxes: Arc<[Served<DB>]> = inboxes
        .iter()
        .map(|inbox| Served {
            // Not a worker's inbox: a connection kept between batches would be missed by the
            // program on a small pool (an in-memory SQLite database has one), and the pool's
            // check of a connection costs a batch next to nothing.
            inbox: inbox.clone(),
            metrics: OutboxMetrics::new(&inbox.table().to_string()),
        })
        .collect();
    let workers = wakes
        .into_iter()
        .enumerate()
        .map(|(index, wake)| {
            let worker = Worker {
                outboxes: outboxes.clone(),
                first: index * outboxes.len() / options.workers.max(1),
                publisher: publisher.clone(),
                options: options.clone(),
                counters: counters.clone(),
                wake,
                stopped: stopped.clone(),
                samples_backlog: index == 0,
                share: KeyShare::of(index, options.workers),
            };
            tokio::spawn(worker.run())
        })
        .collect();
    Relay {
        stop,
        workers,
        listeners,
        counters,
    }
}

/// One inbox a relay publishes from.
struct Served<DB: Backend> {
    inbox: Inbox<DB>,
    metrics: OutboxMetrics,
}

struct Worker<DB: Backend, P> {
    outboxes: Arc<[Served<DB>]>,
    /// The outbox this worker's next round begins with.
    first: usize,
    publisher: Arc<P>,
    options: Arc<RelayOptions>,
    counters: Arc<Counters>,
    wake: Arc<Notify>,
    stopped: watch::Receiver<bool>,
    samples_backlog: bool,
    /// The ordering keys this worker takes.
    share: KeyShare,
}

/// What one round over a relay's outboxes did.
#[derive(Default)]
struct Round {
    taken: usize,
    published: usize,
    unavailable: usize,
    /// An outbox filled its batch: more may be waiting.
    full: bool,
    failed: usize,
}

impl<DB: Backend, P: Publisher> Worker<DB, P> {
    async fn run(mut self) {
        let options = self.options.clone();
        let mut idle = options.min_poll_interval;
        let mut trouble = Duration::ZERO;
        let mut sampled: Option<Instant> = None;
        while !*self.stopped.borrow() {
            if self.samples_backlog
                && sampled.is_none_or(|at| at.elapsed() >= options.backlog_every)
            {
                sampled = Some(Instant::now());
                for outbox in &*self.outboxes {
                    sample_backlog(outbox).await;
                }
            }
            let round = self.round().await;
            let wait = if round.failed == self.outboxes.len()
                || (round.unavailable > 0 && round.published == 0)
            {
                // Every batch failed on the database, or nothing got through to the broker (down,
                // blocking publishers): back off. A refusal, or some rows not confirmed while
                // others were, is the rows' own trouble: their back-off is their own (`due_at`),
                // and the others go on at once.
                trouble = next_pause(trouble);
                trouble
            } else {
                trouble = Duration::ZERO;
                if round.full {
                    idle = options.min_poll_interval;
                    continue;
                }
                let wait = if round.taken > 0 {
                    options.min_poll_interval
                } else {
                    idle
                };
                idle = if round.taken > 0 {
                    options.min_poll_interval
                } else {
                    (idle * 2).min(options.max_poll_interval)
                };
                wait
            };
            tokio::select! {
                () = self.wake.notified(), if trouble.is_zero() => {}
                () = tokio::time::sleep(wait) => {}
                _ = self.stopped.changed() => {}
            }
        }
    }

    /// One batch of each outbox, from this worker's first; the next round begins one further.
    async fn round(&mut self) -> Round {
        let mut round = Round::default();
        let count = self.outboxes.len();
        for offset in 0..count {
            if *self.stopped.borrow() {
                break;
            }
            let outbox = &self.outboxes[(self.first + offset) % count];
            let batch = batch(
                &outbox.inbox,
                &*self.publisher,
                &self.options,
                &outbox.metrics,
                self.share,
            )
            .await;
            match batch {
                Ok(report) => {
                    self.counters.count(&report);
                    round.taken += report.taken;
                    round.published += report.published;
                    round.unavailable += report.unavailable;
                    round.full |= report.taken >= self.options.batch_size;
                }
                Err(error) => {
                    self.counters.failed_batches.fetch_add(1, Ordering::Relaxed);
                    round.failed += 1;
                    tracing::warn!(table = %outbox.inbox.table(), %error, "an outbox batch failed; trying again");
                }
            }
        }
        self.first = (self.first + 1) % count.max(1);
        round
    }
}

/// Counts an outbox's backlog for the metrics; a failure is only logged.
async fn sample_backlog<DB: Backend>(outbox: &Served<DB>) {
    match backlog(&outbox.inbox).await {
        Ok((rows, oldest)) => outbox.metrics.backlog(rows, oldest),
        Err(error) => tracing::debug!(%error, "could not count the outbox's backlog"),
    }
}

/// The pause after `last` (zero: none yet) when something keeps failing: 100 ms, doubling, at most
/// 10 s.
fn next_pause(last: Duration) -> Duration {
    if last.is_zero() {
        Duration::from_millis(100)
    } else {
        (last * 2).min(Duration::from_secs(10))
    }
}

/// `(pending rows, age of the oldest)`.
pub(crate) async fn backlog<DB: Backend>(inbox: &Inbox<DB>) -> Result<(u64, Duration), InboxError> {
    let failed = || database_error(Stage::Relay);
    let mut session = Session::take(inbox.source()).await.map_err(failed())?;
    let (rows, oldest, now) = session
        .try_step(|conn| DB::outbox_backlog(conn, &inbox.config.statements.outbox))
        .await
        .map_err(failed())?;
    let age = oldest.map_or(0, |oldest| now.saturating_sub(oldest).max(0));
    Ok((rows.max(0) as u64, Duration::from_millis(age as u64)))
}

/// One batch, of the ordering keys of `share`; see the module docs.
pub(crate) async fn batch<DB: Backend, P: Publisher>(
    inbox: &Inbox<DB>,
    publisher: &P,
    options: &RelayOptions,
    metrics: &OutboxMetrics,
    share: KeyShare,
) -> Result<RelayReport, InboxError> {
    let span = tracing::info_span!(
        "outbox_batch",
        table = %inbox.table(),
        taken = tracing::field::Empty,
        published = tracing::field::Empty,
        rejected = tracing::field::Empty,
        parked = tracing::field::Empty,
        unavailable = tracing::field::Empty,
        held_back = tracing::field::Empty,
    );
    let report = tracing::Instrument::instrument(
        run_batch(inbox, publisher, options, metrics, share),
        span.clone(),
    )
    .await?;
    if report.taken > 0 {
        span.record("taken", report.taken);
        span.record("published", report.published);
        span.record("rejected", report.rejected);
        span.record("parked", report.parked);
        span.record("unavailable", report.unavailable);
        span.record("held_back", report.held_back);
        tracing::debug!(parent: &span, ?report, "outbox batch committed");
    }
    Ok(report)
}

async fn run_batch<DB: Backend, P: Publisher>(
    inbox: &Inbox<DB>,
    publisher: &P,
    options: &RelayOptions,
    metrics: &OutboxMetrics,
    share: KeyShare,
) -> Result<RelayReport, InboxError> {
    let statements = &inbox.config.statements.outbox;
    let failed = || database_error(Stage::Relay);
    let mut tx = InboxTransaction::begin_as(inbox.resources(), DB::BEGIN_RELAY)
        .await
        .map_err(|error| match error {
            BeginError::Acquire(error) | BeginError::Begin(error) => failed()(error),
        })?;
    let taken = DB::outbox_take(
        tx.connection(),
        statements,
        options.batch_size,
        options.parked_rows(),
        share,
    );
    let rows = match taken.await {
        Ok(rows) => rows,
        Err(error) => {
            let _ = tx.rollback().await;
            return Err(failed()(error));
        }
    };
    if rows.is_empty() {
        tx.rollback().await.map_err(failed())?;
        return Ok(RelayReport::default());
    }
    let taken_at = Instant::now();
    let publications: Vec<Publication> = rows
        .iter()
        .map(|row| Publication {
            message_id: row.message_id.clone(),
            destination: Destination::exchange(row.exchange.clone(), row.routing_key.clone()),
            payload: row.payload.clone(),
            headers: decode_headers(row.headers.as_deref()),
            ordering_key: row.ordering_key.clone(),
            attempt: u32::try_from(row.attempts)
                .unwrap_or(u32::MAX)
                .saturating_add(1),
        })
        .collect();
    let outcomes = publish_in_key_order(&rows, &publications, publisher, options).await;

    let mut report = RelayReport {
        taken: rows.len(),
        ..RelayReport::default()
    };
    let mut sent = Vec::new();
    let mut unconfirmed = Vec::new();
    let mut delays = Vec::new();
    let conn = tx.connection();
    for (row, outcome) in rows.iter().zip(&outcomes) {
        let Some(outcome) = outcome else {
            // After a failure of its key: as it was, pending (taken marked sent: set back).
            report.held_back += 1;
            unconfirmed.push(row.id);
            continue;
        };
        match outcome {
            Ok(()) => {
                sent.push(row.id);
                let queued_ms = row.now_ms.saturating_sub(row.created_at).max(0) as u64;
                delays.push(Duration::from_millis(queued_ms) + taken_at.elapsed());
            }
            Err(PublishError::Rejected { reason }) => {
                let attempts = row.attempts.saturating_add(1);
                let park = attempts >= i64::from(options.max_attempts);
                let attempt = u32::try_from(attempts).unwrap_or(u32::MAX);
                let error = shorten(reason);
                let failure = Failure {
                    id: row.id,
                    state: if park { PARKED } else { PENDING },
                    attempts,
                    delay_ms: millis(options.retry_delay(attempt)),
                    error: &error,
                };
                if park {
                    report.parked += 1;
                    tracing::warn!(message_id = %row.message_id, attempts, %reason, "parked an outgoing message the broker keeps refusing");
                } else {
                    report.rejected += 1;
                    tracing::info!(message_id = %row.message_id, attempts, %reason, "the broker refused an outgoing message; trying again later");
                }
                if let Err(error) = DB::outbox_mark_failed(&mut *conn, statements, failure).await {
                    let _ = tx.rollback().await;
                    return Err(failed()(error));
                }
            }
            Err(error @ PublishError::Unavailable(_)) => {
                report.unavailable += 1;
                unconfirmed.push(row.id);
                tracing::debug!(message_id = %row.message_id, %error, "an outgoing message was not confirmed; trying again later");
            }
        }
    }
    // The rows were taken marked sent (PostgreSQL, SQLite): set back those not confirmed (the
    // refused ones were just above). Or taken as they were: mark the confirmed ones.
    let (ids, sent_state) = if statements.marks_on_take() {
        (&unconfirmed, false)
    } else {
        (&sent, true)
    };
    if !ids.is_empty()
        && let Err(error) = DB::outbox_set_sent(&mut *conn, statements, ids, sent_state).await
    {
        let _ = tx.rollback().await;
        return Err(failed()(error));
    }
    // A failed commit leaves every row pending: published again by the next batch.
    commit(tx, None).await.map_err(|error| match error {
        InboxError::Database { source, .. } => failed()(source),
        other => other,
    })?;
    report.published = sent.len();
    metrics.published(&delays);
    metrics.retried(true, report.rejected as u64);
    metrics.retried(false, report.unavailable as u64);
    metrics.parked(report.parked as u64);
    Ok(report)
}

/// Publishes the `publications` of the batch's `rows` (one each, in the same order): those without
/// an ordering key at once, each key's one after another in the key's order, each once the one
/// before was confirmed, the keys side by side. A key's first failure ends its turn: what comes
/// after it is not published (`None`).
async fn publish_in_key_order<P: Publisher>(
    rows: &[TakenRow],
    publications: &[Publication],
    publisher: &P,
    options: &RelayOptions,
) -> Vec<Option<Result<(), PublishError>>> {
    // Each lane: the indexes of the rows it publishes in turn.
    let mut lanes: Vec<Vec<usize>> = Vec::new();
    let mut of_key: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for (index, row) in rows.iter().enumerate() {
        match row.ordering_key.as_deref() {
            None => lanes.push(vec![index]),
            Some(key) => {
                let lane = *of_key.entry(key).or_insert_with(|| {
                    lanes.push(Vec::new());
                    lanes.len() - 1
                });
                lanes[lane].push(index);
            }
        }
    }
    for lane in &mut lanes {
        lane.sort_by_key(|index| rows[*index].ordering_seq);
    }
    let publish_one = |index: usize| {
        let publication = &publications[index];
        async move {
            let published = publisher.publish(publication);
            match tokio::time::timeout(options.publish_timeout, published).await {
                Ok(outcome) => outcome,
                Err(_) => Err(PublishError::unavailable(format!(
                    "no confirmation within {:?}",
                    options.publish_timeout
                ))),
            }
        }
    };
    let lanes = futures_util::future::join_all(lanes.into_iter().map(|lane| async move {
        let mut done = Vec::with_capacity(lane.len());
        for index in lane {
            let outcome = publish_one(index).await;
            let failed = outcome.is_err();
            done.push((index, outcome));
            if failed {
                break;
            }
        }
        done
    }))
    .await;
    let mut outcomes: Vec<Option<Result<(), PublishError>>> =
        std::iter::repeat_with(|| None).take(rows.len()).collect();
    for (index, outcome) in lanes.into_iter().flatten() {
        outcomes[index] = Some(outcome);
    }
    outcomes
}

/// At most a thousand bytes of `text`.
fn shorten(text: &str) -> String {
    if text.len() <= 1000 {
        return text.to_owned();
    }
    let mut end = 1000;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_double_up_to_the_longest() {
        let options = RelayOptions::default().attempts(5, Duration::from_secs(1));
        let delays: Vec<u64> = (1..=4).map(|n| options.retry_delay(n).as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8]);
        assert_eq!(options.retry_delay(40), Duration::from_secs(300));
    }
}
