//! How long inbox rows are kept, and the purge that deletes them afterwards.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::error::{InboxError, Stage};
use crate::metrics::Metrics;
use crate::session::{Session, Source};
use crate::store::{Backend, PurgeLock, Statements, database_error};
use crate::table::TableName;

/// How long processed rows are kept: a default, and overrides per consumer.
///
/// A row must outlive every possible redelivery of its message: a message that is redelivered
/// after its row was purged is processed again. Brokers redeliver within minutes, but a message
/// parked in a dead-letter queue can be resubmitted by an operator days later, so the default is
/// 14 days: the longest retention of an SQS queue and twice a week-long incident. Set it longer if
/// your dead-letter queues keep messages longer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retention {
    pub(crate) default: Duration,
    pub(crate) per_consumer: BTreeMap<String, Duration>,
}

impl Retention {
    /// The default retention: 14 days.
    pub const DEFAULT: Duration = Duration::from_secs(14 * 24 * 60 * 60);

    /// How long `consumer`'s rows are kept.
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
        }
    }
}

/// What one purge did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PurgeReport {
    /// Rows deleted.
    pub deleted: u64,
    /// Batches (transactions) it took.
    pub batches: u64,
    /// Another instance was purging, so this one did nothing.
    pub locked_elsewhere: bool,
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
    /// The defaults, with another interval.
    pub fn every(interval: Duration) -> Self {
        Self {
            interval,
            ..Self::default()
        }
    }

    /// These options with another batch size.
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

/// `duration` in whole milliseconds, saturated at `i64::MAX`.
pub(crate) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// What one purge works on.
pub(crate) struct Scope<'a> {
    pub(crate) table: &'a TableName,
    pub(crate) statements: &'a Statements,
    pub(crate) retention: &'a Retention,
    pub(crate) metrics: &'a Metrics,
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
    tracing::info!(
        %table,
        deleted = report.deleted,
        batches = report.batches,
        "purged expired inbox rows"
    );
    Ok(report)
}

async fn purge_locked<DB: Backend>(
    source: Source<'_, DB>,
    scope: &Scope<'_>,
    batch_size: usize,
    pause: Duration,
) -> Result<PurgeReport, InboxError> {
    let batch = i64::try_from(batch_size).unwrap_or(i64::MAX);
    let Scope {
        retention,
        statements,
        metrics,
        ..
    } = scope;
    let overridden: Vec<String> = retention.per_consumer.keys().cloned().collect();
    let mut scopes: Vec<(String, i64, Vec<String>)> = retention
        .per_consumer
        .iter()
        .map(|(consumer, retention)| {
            (
                statements.purge(true, 0),
                millis(*retention),
                vec![consumer.clone()],
            )
        })
        .collect();
    scopes.push((
        statements.purge(false, overridden.len()),
        millis(retention.default),
        overridden,
    ));
    let mut session = Session::take(source)
        .await
        .map_err(database_error(Stage::Purge))?;
    let mut report = PurgeReport::default();
    for (statement, retention_ms, consumers) in &scopes {
        loop {
            let conn = session.start_step();
            let deleted =
                DB::purge_batch(conn, statements, statement, *retention_ms, consumers, batch)
                    .await
                    .map_err(database_error(Stage::Purge))?;
            session.end_step();
            report.deleted += deleted;
            report.batches += 1;
            metrics.purged(deleted);
            if deleted < batch as u64 {
                break;
            }
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
        }
    }
    Ok(report)
}

/// Runs `purge` every `options.interval` in a tokio task, logging its failures.
pub(crate) fn spawn<F>(options: PurgerOptions, table: TableName, mut purge: F) -> Purger
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
