//! The purge of an inbox's expired rows, now, as a dry run, or in a task of its own.

use std::time::Duration;

use super::Inbox;
use crate::error::InboxError;
use crate::retention::{self, Expired, PurgeReport, Purger, PurgerOptions};
use crate::session::Source;
use crate::store::Backend;

impl<DB: Backend> Inbox<DB> {
    /// Deletes every expired row, `batch_size` rows per transaction, oldest first, using the index
    /// on `processed_at`; each batch is one short statement, so claims wait for at most one batch.
    /// Before it deletes a consumer's rows it records the consumer's purge horizon (see
    /// [`Retention`](crate::Retention)); then it deletes the expired call records and audit rows the same way.
    /// Does nothing when another instance is purging the same table (PostgreSQL advisory lock,
    /// MySQL `GET_LOCK`). Dropped half-way (a timeout around it), it leaves nothing behind: its
    /// batch rolls back and the session holding the lock is closed.
    ///
    /// On PostgreSQL it then runs `VACUUM` on the inbox and outbox tables it deleted rows from, on
    /// a connection of its own: a purge of a fifth of a table never reaches autovacuum's default
    /// threshold, and until the table is vacuumed the space of the deleted rows is not reused, so
    /// the table would grow by every purge (the performance guide has the figures).
    /// `VACUUM` does not block the handlers' reads and writes; a failure is logged, not returned.
    pub async fn purge_expired(&self, batch_size: usize) -> Result<PurgeReport, InboxError> {
        self.purge(batch_size, Duration::ZERO).await
    }

    /// One purge, with `pause` between its batches.
    pub(crate) async fn purge(
        &self,
        batch_size: usize,
        pause: Duration,
    ) -> Result<PurgeReport, InboxError> {
        let source = Source {
            keeps: false,
            ..self.source()
        };
        let scope = retention::Scope {
            table: &self.config.table,
            statements: &self.config.statements,
            retention: &self.config.retention,
            metrics: &self.metrics,
        };
        retention::purge(source, scope, batch_size, pause).await
    }

    /// Returns what [`purge_expired`](Self::purge_expired) would delete now, per consumer, without
    /// deleting anything (the CLI's `purge --dry-run`).
    pub async fn purge_preview(&self) -> Result<Vec<Expired>, InboxError> {
        let source = Source {
            keeps: false,
            ..self.source()
        };
        retention::preview(source, &self.config.statements, &self.config.retention).await
    }

    /// Starts a tokio task that purges expired rows every `options.interval`. Safe to start in
    /// every instance: only one purges a table at a time, the others skip their turn. It reports
    /// what it deleted through `tracing` (and [`metrics`](Inbox::metrics)); a failed purge is logged
    /// and tried again at the next interval. It runs until the returned [`Purger`] is stopped or
    /// dropped.
    pub fn spawn_purger(&self, options: PurgerOptions) -> Purger {
        let inbox = self.clone();
        retention::spawn(
            options,
            self.config.table.to_string(),
            move |batch, pause| {
                let inbox = inbox.clone();
                Box::pin(async move { inbox.purge(batch, pause).await })
            },
        )
    }
}
