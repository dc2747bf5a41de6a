//! How long inbox rows are kept, and the purge that deletes them afterwards.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::error::{InboxError, Stage};
use crate::inbox::Inbox;
use crate::store::Backend;

/// How long processed rows are kept: a default, and overrides per consumer.
///
/// A row must outlive every possible redelivery of its message: a message that is redelivered
/// after its row was purged is processed again. Brokers redeliver within minutes, but a message
/// parked in a dead-letter queue can be resubmitted by an operator days later, so the default is
/// 14 days: the longest retention of an SQS queue and twice a week-long incident. Set it longer if
/// your dead-letter queues keep messages longer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retention {
    default: Duration,
    per_consumer: BTreeMap<String, Duration>,
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

/// How the background purger works; see [`Inbox::spawn_purger`].
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

/// A running background purger; stops when dropped or [stopped](Purger::stop).
#[derive(Debug)]
pub struct Purger {
    task: tokio::task::JoinHandle<()>,
}

impl Purger {
    /// Stops the purger (a purge in progress stops after its current statement).
    pub fn stop(self) {
        self.task.abort();
    }
}

impl Drop for Purger {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

impl<DB: Backend> Inbox<DB> {
    /// Keeps rows for `retention` after they were processed (see [`Retention`] for the default and
    /// why), for every consumer without an override.
    pub fn with_retention(self, retention: Duration) -> Self {
        let mut config = (*self.retention).clone();
        config.default = retention;
        Self {
            retention: config.into(),
            ..self
        }
    }

    /// Keeps `consumer`'s rows for `retention`.
    pub fn with_consumer_retention(self, consumer: &str, retention: Duration) -> Self {
        let mut config = (*self.retention).clone();
        config.per_consumer.insert(consumer.to_owned(), retention);
        Self {
            retention: config.into(),
            ..self
        }
    }

    /// How long rows are kept.
    pub fn retention(&self) -> &Retention {
        &self.retention
    }

    /// Deletes every expired row, `batch_size` rows per transaction, oldest first, using the index
    /// on `processed_at`; each batch is one short statement, so claims wait for at most one batch.
    /// Does nothing when another instance is purging the same table (PostgreSQL advisory lock,
    /// MySQL `GET_LOCK`).
    pub async fn purge_expired(&self, batch_size: usize) -> Result<PurgeReport, InboxError> {
        self.purge(batch_size.max(1), Duration::ZERO).await
    }

    async fn purge(&self, batch_size: usize, pause: Duration) -> Result<PurgeReport, InboxError> {
        let error = InboxError::database(Stage::Purge);
        let Some(lock) = DB::try_lock_purge(&self.pool, &self.table)
            .await
            .map_err(error)?
        else {
            tracing::debug!(table = %self.table, "another instance is purging");
            return Ok(PurgeReport {
                locked_elsewhere: true,
                ..PurgeReport::default()
            });
        };
        let result = self.purge_locked(batch_size, pause).await;
        let unlocked = DB::unlock_purge(lock, &self.table).await;
        let report = result?;
        unlocked.map_err(InboxError::database(Stage::Purge))?;
        tracing::info!(
            table = %self.table,
            deleted = report.deleted,
            batches = report.batches,
            "purged expired inbox rows"
        );
        Ok(report)
    }

    async fn purge_locked(
        &self,
        batch_size: usize,
        pause: Duration,
    ) -> Result<PurgeReport, InboxError> {
        let batch = i64::try_from(batch_size).unwrap_or(i64::MAX);
        let overridden: Vec<String> = self.retention.per_consumer.keys().cloned().collect();
        let mut scopes: Vec<(String, i64, Vec<String>)> = self
            .retention
            .per_consumer
            .iter()
            .map(|(consumer, retention)| {
                (
                    self.statements.purge(true, 0),
                    millis(*retention),
                    vec![consumer.clone()],
                )
            })
            .collect();
        scopes.push((
            self.statements.purge(false, overridden.len()),
            millis(self.retention.default),
            overridden,
        ));
        let mut report = PurgeReport::default();
        for (statement, retention_ms, consumers) in &scopes {
            loop {
                let deleted =
                    DB::purge_batch(&self.pool, statement, *retention_ms, consumers, batch)
                        .await
                        .map_err(InboxError::database(Stage::Purge))?;
                report.deleted += deleted;
                report.batches += 1;
                self.metrics.purged(deleted);
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

    /// Starts a tokio task that purges expired rows every `options.interval`. Safe to start in
    /// every instance: only one purges a table at a time, the others skip their turn. It reports
    /// what it deleted through `tracing` (and [`metrics`](Inbox::metrics)); a failed purge is logged
    /// and tried again at the next interval.
    pub fn spawn_purger(&self, options: PurgerOptions) -> Purger {
        let inbox = self.clone();
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval(options.interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                if let Err(error) = inbox.purge(options.batch_size.max(1), options.pause).await {
                    tracing::warn!(table = %inbox.table, %error, "purge failed; trying again later");
                }
            }
        });
        Purger { task }
    }
}
