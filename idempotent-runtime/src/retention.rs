//! How long inbox rows are kept, the purge that deletes them afterwards, and the horizon it
//! leaves behind.
//!
//! # The purge horizon
//! A message redelivered after its row was purged would look new. So before a purge deletes a
//! consumer's expired rows, it records the cutoff as the consumer's *horizon* (in
//! `<table>_horizons`, only moving forward): rows processed before it may be gone. A message that
//! says when it was sent (a UUIDv7 key, or `#[idempotent(sent_at = "...")]`) and whose claim finds
//! no row is checked against it, in the claim's transaction: sent before the horizon (plus the
//! [clock-skew margin](Retention::skew_margin)), it is refused with
//! [`InboxError::OlderThanHorizon`] instead of being processed again. A row that is still there is
//! a duplicate, however old. Messages that carry no send time are not checked: redelivered after
//! their row was purged, they are processed again.
//!
//! The horizon is recorded before the rows are deleted, and read after the claim's insert, so a
//! claim that found a row gone also sees the horizon that its deletion was under.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use crate::clock::{from_ms, millis, to_ms};
use crate::error::{InboxError, Stage};
use crate::key::MessageKey;
use crate::metrics::{Metrics, Purged};
use crate::session::{Session, Source};
use crate::store::{
    Backend, PurgeLock, PurgeScope, PurgeSql, PurgeStatements, Statements, database_error,
};
use crate::table::TableName;

/// How long processed rows are kept: a default, and overrides per consumer.
///
/// A row must outlive every possible redelivery of its message: a message that is redelivered
/// after its row was purged is processed again. Brokers redeliver within minutes, but a message
/// parked in a dead-letter queue can be resubmitted by an operator days later, so the default is
/// 14 days: the longest retention of an SQS queue and twice a week-long incident. Set it longer if
/// your dead-letter queues keep messages longer.
///
/// The same retention applies to a consumer's call records (completed, or pending with a lease
/// that ran out, counted from their last change) and to its audit rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retention {
    pub(crate) default: Duration,
    pub(crate) per_consumer: BTreeMap<String, Duration>,
    pub(crate) skew_margin: Duration,
    /// How long sent outgoing messages are kept.
    pub(crate) outbox: Duration,
}

impl Retention {
    /// The default retention: 14 days.
    pub const DEFAULT: Duration = Duration::from_secs(14 * 24 * 60 * 60);

    /// The default clock-skew margin: 1 hour.
    pub const DEFAULT_SKEW_MARGIN: Duration = Duration::from_secs(60 * 60);

    /// How long sent outgoing messages are kept by default: 24 hours.
    pub const DEFAULT_OUTBOX: Duration = Duration::from_secs(24 * 60 * 60);

    /// Returns how long the [outbox](crate::outbox)'s sent messages are kept after they were sent,
    /// and skipped ones after they were skipped (default [`DEFAULT_OUTBOX`](Self::DEFAULT_OUTBOX);
    /// [`Inbox::with_outbox_retention`](crate::Inbox::with_outbox_retention) changes it). Pending
    /// and parked messages are never purged.
    pub fn outbox(&self) -> Duration {
        self.outbox
    }

    /// Returns the margin between a producer's clock, which stamps a message's send time, and the
    /// database's, which sets the purge horizon: a message is refused as older than the horizon
    /// when it was sent before the horizon plus this margin. A producer whose clock runs ahead of
    /// the database's by less than the margin cannot slip a purged message past the check; the
    /// price is that a message never processed before, sent within the margin after the horizon
    /// (some two weeks ago, with the default retention), is refused too and dead-lettered.
    /// Default [`DEFAULT_SKEW_MARGIN`](Self::DEFAULT_SKEW_MARGIN);
    /// [`Inbox::with_clock_skew_margin`](crate::Inbox::with_clock_skew_margin) changes it.
    pub fn skew_margin(&self) -> Duration {
        self.skew_margin
    }

    /// Returns how long `consumer`'s rows are kept.
    pub fn of(&self, consumer: &str) -> Duration {
        self.per_consumer
            .get(consumer)
            .copied()
            .unwrap_or(self.default)
    }
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            default: Self::DEFAULT,
            per_consumer: BTreeMap::new(),
            skew_margin: Self::DEFAULT_SKEW_MARGIN,
            outbox: Self::DEFAULT_OUTBOX,
        }
    }
}

/// What one purge did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeReport {
    /// Inbox rows deleted.
    pub deleted: u64,
    /// Call records deleted.
    pub calls_deleted: u64,
    /// Audit rows deleted.
    pub audit_deleted: u64,
    /// Sent (and skipped) outgoing messages deleted (see [`Retention::outbox`]).
    pub outbox_deleted: u64,
    /// Batches (transactions) it took.
    pub batches: u64,
    /// Another instance was purging, so this one did nothing.
    pub locked_elsewhere: bool,
}

impl PurgeReport {
    /// Adds what `other` deleted (the purges of several tenants); locked elsewhere if either was.
    pub(crate) fn add(&mut self, other: &PurgeReport) {
        self.deleted += other.deleted;
        self.calls_deleted += other.calls_deleted;
        self.audit_deleted += other.audit_deleted;
        self.outbox_deleted += other.outbox_deleted;
        self.batches += other.batches;
        self.locked_elsewhere |= other.locked_elsewhere;
    }
}

/// How the background purger works; see [`Inbox::spawn_purger`](crate::Inbox::spawn_purger).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct PurgerOptions {
    /// Time between purges (default 10 minutes).
    pub interval: Duration,
    /// Rows deleted per transaction (default 1000): a claim waits for at most one batch.
    pub batch_size: usize,
    /// Pause between batches, to leave the database to the handlers (default 10 ms).
    pub pause: Duration,
}

impl Default for PurgerOptions {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(600),
            batch_size: 1000,
            pause: Duration::from_millis(10),
        }
    }
}

impl PurgerOptions {
    /// Creates the default options with another interval.
    pub fn every(interval: Duration) -> Self {
        Self {
            interval,
            ..Self::default()
        }
    }

    /// Returns these options with another batch size.
    pub fn batch_size(self, batch_size: usize) -> Self {
        Self { batch_size, ..self }
    }
}

/// A running background purger; stops when dropped or [stopped](Purger::stop), so keep it for as
/// long as it should run (or [`detach`](Purger::detach) it).
#[derive(Debug)]
#[must_use = "the purger stops when dropped: keep it for as long as it should run, or detach it"]
pub struct Purger {
    task: tokio::task::JoinHandle<()>,
}

impl Purger {
    /// Stops the purger. A purge in progress stops where it is: its batch rolls back, and its
    /// session (which holds the purger's lock) is closed, which releases the lock.
    pub fn stop(self) {
        self.task.abort();
    }

    /// Lets the purger run until the runtime shuts down, with nothing left to stop it.
    pub fn detach(self) {
        std::mem::forget(self);
    }
}

impl Drop for Purger {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What a purge would delete for one consumer now: see
/// [`Inbox::purge_preview`](crate::Inbox::purge_preview).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Expired {
    /// The consumer.
    pub consumer: String,
    /// Inbox rows older than its retention.
    pub rows: u64,
    /// Call records a purge would delete.
    pub calls: u64,
    /// Audit rows older than its retention.
    pub audit: u64,
}

/// What one purge works on.
pub(crate) struct Scope<'a> {
    pub(crate) table: &'a TableName,
    pub(crate) statements: &'a Statements,
    pub(crate) retention: &'a Retention,
    pub(crate) metrics: &'a Metrics,
}

/// One pass of the purge: its statements, the retention of its consumers, the consumers.
struct Pass {
    statements: PurgeStatements,
    retention_ms: i64,
    consumers: Vec<String>,
}

/// The passes over `retention`: one per consumer with a retention of its own, then one over every
/// other consumer.
fn passes(statements: &Statements, retention: &Retention) -> Vec<Pass> {
    let mut passes: Vec<Pass> = retention
        .per_consumer
        .iter()
        .map(|(consumer, retention)| Pass {
            statements: statements.horizons.purge(PurgeScope::Consumer),
            retention_ms: millis(*retention),
            consumers: vec![consumer.clone()],
        })
        .collect();
    let overridden: Vec<String> = retention.per_consumer.keys().cloned().collect();
    passes.push(Pass {
        statements: statements
            .horizons
            .purge(PurgeScope::AllBut(overridden.len())),
        retention_ms: millis(retention.default),
        consumers: overridden,
    });
    passes
}

/// The cutoff of a retention, given the database's clock: never before the epoch.
fn cutoff(now_ms: i64, retention_ms: i64) -> i64 {
    now_ms.saturating_sub(retention_ms).max(0)
}

/// Deletes every expired row, `batch_size` rows per statement, oldest first, pausing `pause`
/// between batches; does nothing when another instance holds the purger's lock. Dropped half-way,
/// it leaves nothing behind: the batch in flight rolls back with its closed connection, and the
/// session holding the lock is closed too.
pub(crate) async fn purge<DB: Backend>(
    source: Source<'_, DB>,
    scope: Scope<'_>,
    batch_size: usize,
    pause: Duration,
) -> Result<PurgeReport, InboxError> {
    let table = scope.table;
    let pooled = scope.statements.pooled;
    let Some(lock) = PurgeLock::<DB>::try_lock(source.pool, table, pooled)
        .await
        .map_err(database_error(Stage::Purge))?
    else {
        tracing::debug!(%table, "another instance is purging");
        return Ok(PurgeReport {
            locked_elsewhere: true,
            ..PurgeReport::default()
        });
    };
    // On an error the lock is dropped, which closes its session.
    let report = purge_locked(source, &scope, batch_size.max(1), pause).await?;
    lock.unlock(table)
        .await
        .map_err(database_error(Stage::Purge))?;
    vacuum::<DB>(source.pool, table, &report).await;
    tracing::info!(
        %table,
        deleted = report.deleted,
        calls_deleted = report.calls_deleted,
        audit_deleted = report.audit_deleted,
        outbox_deleted = report.outbox_deleted,
        batches = report.batches,
        "purged expired inbox rows"
    );
    Ok(report)
}

/// Reclaims the space of the rows `report` deleted, where the database needs to be told
/// ([`Dialect::vacuum`](crate::store::Dialect)): autovacuum's default threshold (a fifth of the
/// table dead) is never crossed by a purge of less, and until a table is vacuumed its next inserts
/// go to new pages. Outside the purger's lock (a pooler's transaction holds that), on a connection
/// of its own; a failure is only logged: the rows are gone, and autovacuum comes later.
async fn vacuum<DB: Backend>(pool: &sqlx::Pool<DB>, table: &TableName, report: &PurgeReport) {
    let Some(vacuum) = DB::DIALECT.vacuum else {
        return;
    };
    let quote = DB::DIALECT.quote;
    let tables = [
        (table.quoted(quote), report.deleted),
        (
            table.quoted_suffixed("outbox", quote),
            report.outbox_deleted,
        ),
    ];
    for (name, deleted) in tables {
        if deleted == 0 {
            continue;
        }
        let sql = vacuum.replace("{t}", &name);
        let vacuumed = match pool.acquire().await {
            Ok(mut conn) => DB::run(&mut conn, &sql).await.map(drop),
            Err(error) => Err(error),
        };
        match vacuumed {
            Ok(()) => tracing::debug!(table = %name, deleted, "vacuumed after the purge"),
            Err(error) => tracing::warn!(table = %name, %error, "could not vacuum after the purge"),
        }
    }
}

async fn purge_locked<DB: Backend>(
    source: Source<'_, DB>,
    scope: &Scope<'_>,
    batch_size: usize,
    pause: Duration,
) -> Result<PurgeReport, InboxError> {
    let batch = i64::try_from(batch_size).unwrap_or(i64::MAX);
    let failed = || database_error(Stage::Purge);
    let mut session = Session::take(source).await.map_err(failed())?;
    // One clock for the whole purge: the horizon it records covers every row it deletes.
    let now = session
        .try_step(|conn| DB::now_ms(conn, &scope.statements.horizons))
        .await
        .map_err(failed())?;
    let mut report = PurgeReport::default();
    for pass in passes(scope.statements, scope.retention) {
        let cutoff = cutoff(now, pass.retention_ms);
        let consumers = &pass.consumers;
        let sql = &pass.statements;
        // The horizon first: a row is never gone without a horizon that covers it. Which
        // consumers have expired rows is a read (no lock a claim would wait for); each horizon
        // is then one short write.
        let expiring = session
            .try_step(|conn| {
                DB::purge_consumers(
                    conn,
                    &scope.statements.horizons,
                    &sql.expiring,
                    cutoff,
                    consumers,
                )
            })
            .await
            .map_err(failed())?;
        for consumer in &expiring {
            session
                .try_step(|conn| {
                    DB::record_horizon(conn, &scope.statements.horizons, consumer, cutoff)
                })
                .await
                .map_err(failed())?;
        }
        let batches = Batches {
            cutoff,
            consumers,
            size: batch,
            pause,
        };
        for (statement, kind) in [
            (&sql.rows, Purged::Inbox),
            (&sql.calls, Purged::Calls),
            (&sql.audit, Purged::Audit),
        ] {
            batches
                .delete(&mut session, scope, statement, kind, &mut report)
                .await?;
        }
    }
    // The outbox's sent and skipped messages, then the ordering keys with nothing left to send.
    let batches = Batches {
        cutoff: cutoff(now, millis(scope.retention.outbox)),
        consumers: &[],
        size: batch,
        pause,
    };
    let outbox = &scope.statements.outbox;
    for (statement, kind) in [
        (&outbox.purge_sent, Purged::Outbox),
        (&outbox.purge_skipped, Purged::Outbox),
        (&outbox.purge_keys, Purged::OutboxKeys),
    ] {
        batches
            .delete(&mut session, scope, statement, kind, &mut report)
            .await?;
    }
    Ok(report)
}

/// How one purge statement deletes: rows older than `cutoff` of `consumers` (all when the
/// statement binds none), `size` at a time, `pause` between batches.
struct Batches<'a> {
    cutoff: i64,
    consumers: &'a [String],
    size: i64,
    pause: Duration,
}

impl Batches<'_> {
    /// Runs `statement` until a batch deletes fewer than `size` rows, counting what it deleted
    /// as `kind` in `report` and the metrics.
    async fn delete<DB: Backend>(
        &self,
        session: &mut Session<DB>,
        scope: &Scope<'_>,
        statement: &PurgeSql,
        kind: Purged,
        report: &mut PurgeReport,
    ) -> Result<(), InboxError> {
        loop {
            let deleted = session
                .try_step(|conn| {
                    DB::purge_step(
                        conn,
                        &scope.statements.horizons,
                        statement,
                        self.cutoff,
                        self.consumers,
                        self.size,
                    )
                })
                .await
                .map_err(database_error(Stage::Purge))?;
            match kind {
                Purged::Inbox => report.deleted += deleted,
                Purged::Calls => report.calls_deleted += deleted,
                Purged::Audit => report.audit_deleted += deleted,
                Purged::Outbox => report.outbox_deleted += deleted,
                Purged::OutboxKeys => {}
            }
            report.batches += 1;
            scope.metrics.purged(scope.table.as_str(), kind, deleted);
            if deleted < self.size as u64 {
                return Ok(());
            }
            if !self.pause.is_zero() {
                tokio::time::sleep(self.pause).await;
            }
        }
    }
}

/// What a purge would delete now, per consumer, without deleting anything.
pub(crate) async fn preview<DB: Backend>(
    source: Source<'_, DB>,
    statements: &Statements,
    retention: &Retention,
) -> Result<Vec<Expired>, InboxError> {
    let failed = || database_error(Stage::Purge);
    let mut session = Session::take(source).await.map_err(failed())?;
    let now = session
        .try_step(|conn| DB::now_ms(conn, &statements.horizons))
        .await
        .map_err(failed())?;
    let mut expired: BTreeMap<String, Expired> = BTreeMap::new();
    for pass in passes(statements, retention) {
        let cutoff = cutoff(now, pass.retention_ms);
        for (i, count) in pass.statements.count.iter().enumerate() {
            let counts = session
                .try_step(|conn| {
                    DB::purge_count(conn, &statements.horizons, count, cutoff, &pass.consumers)
                })
                .await
                .map_err(failed())?;
            for (consumer, n) in counts {
                let entry = expired.entry(consumer.clone()).or_insert_with(|| Expired {
                    consumer,
                    ..Expired::default()
                });
                let n = n.max(0) as u64;
                match i {
                    0 => entry.rows += n,
                    1 => entry.calls += n,
                    _ => entry.audit += n,
                }
            }
        }
    }
    Ok(expired.into_values().collect())
}

/// Refuses a message sent before `consumer`'s horizon (plus `margin`), in the transaction that
/// just claimed its key; see the module docs.
pub(crate) async fn check_horizon<DB: Backend>(
    conn: &mut DB::Connection,
    statements: &Statements,
    consumer: &str,
    key: &MessageKey,
    sent_at: SystemTime,
    margin: Duration,
) -> Result<(), InboxError> {
    let horizon = DB::horizon(conn, &statements.horizons, consumer)
        .await
        .map_err(database_error(Stage::Claim))?;
    match horizon {
        Some(horizon) if to_ms(sent_at) < horizon.saturating_add(millis(margin)) => {
            Err(InboxError::OlderThanHorizon {
                consumer: consumer.to_owned(),
                key: key.clone(),
                sent_at,
                horizon: from_ms(horizon),
            })
        }
        _ => Ok(()),
    }
}

/// Runs `purge` every `options.interval` in a tokio task, logging its failures as those of
/// `table`'s purge.
pub(crate) fn spawn<F>(options: PurgerOptions, table: String, mut purge: F) -> Purger
where
    F: FnMut(usize, Duration) -> BoxFuture<'static, Result<PurgeReport, InboxError>>
        + Send
        + 'static,
{
    let task = tokio::spawn(async move {
        let mut ticks = tokio::time::interval(options.interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            if let Err(error) = purge(options.batch_size.max(1), options.pause).await {
                tracing::warn!(%table, %error, "purge failed; trying again later");
            }
        }
    });
    Purger { task }
}

/// A boxed, sendable future.
pub(crate) type BoxFuture<'a, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;
