//! A transaction in which the caller holds the claim on a message key: the handler's work runs on
//! it, and it ends in a commit or a rollback.

use std::fmt;
use std::sync::Arc;

use serde::Serialize;

use super::commit::{commit, ended_before_abort, ended_by_body, rollback_after};
use super::outgoing::{self, Outbox};
use super::wakeups::Wakeups;
use super::{Config, Handled, Inbox};
use crate::error::{Error, Fault, InboxError, Stage};
use crate::key::{IdempotencyKey, MessageKey};
use crate::metrics::{Metrics, Outcome};
use crate::store::{Backend, RolledBack, database_error, fault_of};
use crate::transaction::InboxTransaction;

/// A transaction in which this caller holds the claim on a message key. Run the handler's work on
/// [`connection`](Self::connection), then [`commit`](Self::commit) to record the effect and the key
/// together. Dropping it (a panic, a cancelled future) rolls back, so the key stays unclaimed.
pub struct Claimed<DB: Backend> {
    tx: InboxTransaction<DB>,
    config: Arc<Config<DB>>,
    metrics: Arc<Metrics>,
    /// The messages to write to the outbox at the commit; it holds the consumer (its origin) and
    /// the claimed key.
    outbox: Outbox,
    /// What wakes the relays once the messages are committed, and the pool it wakes them on.
    wakeups: Arc<Wakeups>,
    pool: sqlx::Pool<DB>,
}

impl<DB: Backend> Claimed<DB> {
    /// The claim of `key` that `tx` holds (made by [`Inbox::claim_with`], or by the HTTP layer's
    /// claim, which does not wait for a concurrent claim of the same key).
    pub(crate) fn new(
        tx: InboxTransaction<DB>,
        consumer: &str,
        key: MessageKey,
        inbox: &Inbox<DB>,
    ) -> Self {
        Self {
            tx,
            outbox: Outbox::of(inbox.config.tenant.clone(), consumer, key),
            config: inbox.config.clone(),
            metrics: inbox.metrics.clone(),
            wakeups: inbox.wakeups.clone(),
            pool: inbox.pool.clone(),
        }
    }

    /// Stores `response` (bytes as they are) with the claimed row, in this transaction: the last
    /// statement before the commit (on PostgreSQL its row proves the transaction, and the commit
    /// makes no check of its own unless the body's connection is taken again).
    pub(crate) async fn store_response(&mut self, response: &[u8]) -> Result<(), InboxError> {
        let proved = DB::set_response(
            self.tx.connection(),
            &self.config.statements.inbox,
            self.outbox.origin(),
            self.outbox.key().as_bytes(),
            response,
        )
        .await
        .map_err(database_error(Stage::StoreResponse))?;
        if proved {
            self.tx.proved();
        }
        Ok(())
    }

    /// Rolls back after `error`, a failure of the stored response's statement, and returns the
    /// error to report: [`InboxError::TransactionEnded`] when the body had ended the transaction
    /// itself (see [`rollback_after`]).
    #[cfg(feature = "http")]
    pub(crate) async fn rollback_after(self, error: InboxError) -> InboxError {
        let Self {
            tx,
            config,
            metrics,
            outbox,
            ..
        } = self;
        let (consumer, key) = (outbox.origin(), outbox.key());
        metrics.message(consumer, Outcome::RolledBack, 1);
        rollback_after(tx, Some((&config.statements, consumer, key)), error).await
    }

    /// Whether the claimed key's row is gone from what this transaction sees: the handler rolled
    /// the transaction back itself (a raw `ROLLBACK`). A read that fails says nothing (a statement
    /// failed in the transaction, which is still the claim's): `false`.
    #[cfg(feature = "http")]
    pub(crate) async fn claim_gone(&mut self) -> bool {
        let row = DB::stored(
            self.tx.connection(),
            &self.config.statements.inbox,
            self.outbox.origin(),
            self.outbox.key().as_bytes(),
        )
        .await;
        matches!(row, Ok(None))
    }

    /// Returns the transaction's connection, for the handler's own statements.
    pub fn connection(&mut self) -> &mut DB::Connection {
        self.tx.body_connection()
    }

    /// Returns the messages to send with this transaction: [`commit`](Self::commit) writes them to
    /// the [outbox](crate::outbox) table before it commits, so that they commit with the handler's
    /// work. Their ids derive from the consumer, the key and their position.
    pub fn outbox(&mut self) -> &mut Outbox {
        &mut self.outbox
    }

    /// Returns the transaction's connection and the outbox, both at once (what a handler with an
    /// `outbox: &mut Outbox` parameter is handed).
    pub fn connection_and_outbox(&mut self) -> (&mut DB::Connection, &mut Outbox) {
        (self.tx.body_connection(), &mut self.outbox)
    }

    /// Returns the claimed key.
    pub fn key(&self) -> &MessageKey {
        self.outbox.key()
    }

    /// The consumer that claimed it.
    fn consumer(&self) -> &str {
        self.outbox.origin()
    }

    /// Returns the key to pass on to an outside service that deduplicates by idempotency key; the
    /// same on every delivery of this message to this consumer.
    pub fn idempotency_key(&self) -> IdempotencyKey {
        IdempotencyKey::new(self.consumer(), self.key())
    }

    /// Commits the handler's work and the claim together, if the transaction is still the one the
    /// claim began and nothing in it failed: otherwise rolls back and returns
    /// [`InboxError::TransactionAborted`] or [`InboxError::TransactionEnded`], never `Ok`.
    pub async fn commit(self) -> Result<(), InboxError> {
        let Self {
            mut tx,
            config,
            metrics,
            outbox,
            wakeups,
            pool,
        } = self;
        let (consumer, key) = (outbox.origin(), outbox.key());
        #[cfg(feature = "testing")]
        if config.injected == Some(super::config::Injected::CrashBeforeCommit) {
            let _ = tx.rollback().await;
            return Err(InboxError::Database {
                stage: Stage::Commit,
                source: sqlx::Error::Protocol(
                    "the testing kit stopped the delivery before its commit, as a crash".into(),
                ),
                fault: Fault::None,
            });
        }
        let claim = (&config.statements, consumer, key);
        let written =
            outgoing::write::<DB>(tx.connection(), &config.statements.outbox, &outbox).await;
        let committed = match written {
            Ok(proved) => {
                // The last row written proved the transaction: the commit needs no read of
                // its own.
                if proved {
                    tx.proved();
                }
                commit(tx, Some(claim)).await
            }
            // Nothing of the message is committed, and its redelivery queues the messages again;
            // unless the body had ended the transaction itself.
            Err(error) => Err(rollback_after(tx, Some(claim), error).await),
        };
        match &committed {
            Ok(()) => {
                if !outbox.is_empty() {
                    wakeups.wake(&pool, &config.statements.outbox);
                }
                metrics.message(consumer, Outcome::Processed, 1);
                tracing::Span::current().record("outcome", "processed");
                tracing::debug!(%consumer, key = %key.digest(), "committed");
            }
            Err(error) => {
                metrics.message(consumer, Outcome::RolledBack, 1);
                tracing::Span::current().record("outcome", "commit failed");
                tracing::warn!(%consumer, key = %key.digest(), %error, "commit failed");
            }
        }
        committed
    }

    /// Rolls back the handler's work and the claim: a redelivery will run the handler again.
    pub async fn rollback(self) {
        self.metrics
            .message(self.consumer(), Outcome::RolledBack, 1);
        tracing::Span::current().record("outcome", "rolled back");
        tracing::debug!(consumer = %self.consumer(), key = %self.key().digest(), "rolled back");
        let _ = self.tx.rollback().await;
    }

    /// Commits on `Ok`, rolls back on `Err`: the end of every rewritten handler. An `Err` is
    /// [`Error::Transient`] when the rollback after it finds the connection dead; handlers
    /// rewritten by `#[idempotent]` also look for a database failure in the error's sources.
    pub async fn finish<T, E>(self, result: Result<T, E>) -> Result<Handled<T>, Error<E>> {
        self.finish_after(result, |_| None).await
    }

    /// [`finish`](Self::finish), storing the `Ok` value (as JSON) with the inbox row, so that a
    /// duplicate can return it.
    pub async fn finish_storing<T: Serialize, E>(
        self,
        result: Result<T, E>,
    ) -> Result<Handled<T>, Error<E>> {
        self.finish_storing_after(result, |_| None).await
    }

    /// [`finish`](Self::finish), with `as_error` to look into the handler's error.
    pub(crate) async fn finish_after<T, E>(
        self,
        result: Result<T, E>,
        as_error: impl for<'a> FnOnce(&'a E) -> Option<&'a (dyn std::error::Error + 'static)>,
    ) -> Result<Handled<T>, Error<E>> {
        let error = match result {
            Ok(value) => {
                self.commit().await?;
                return Ok(Handled::Processed(value));
            }
            Err(error) => error,
        };
        let fault = as_error(&error).map_or(Fault::None, fault_of);
        self.metrics
            .message(self.consumer(), Outcome::RolledBack, 1);
        tracing::Span::current().record("outcome", "rolled back");
        tracing::debug!(consumer = %self.consumer(), key = %self.key().digest(), ?fault, "handler failed; rolled back");
        match fault {
            Fault::None => {}
            // The database failed under the body (a deadlock, a Galera conflict, a lost
            // connection): it ended the transaction, not the body, and a key found committed
            // now would be a concurrent copy's. Retryable.
            Fault::Broken => {
                // The connection is lost, or its prepared statements are: close it.
                self.tx.rollback_and_close().await;
                return Err(Error::Transient(error));
            }
            _ => {
                let _ = self.tx.rollback().await;
                return Err(Error::Transient(error));
            }
        }
        let claim = (
            &self.config.statements,
            self.outbox.origin(),
            self.outbox.key(),
        );
        let (session, later_writes_refused) = match self.tx.rollback_checked().await {
            Ok((RolledBack::Own, _)) => return Err(Error::Handler(error)),
            Ok((RolledBack::Aborted, session)) => {
                return Err(match ended_before_abort(session, Some(claim)).await {
                    Some(ended) => Error::Inbox(ended),
                    None => Error::Handler(error),
                });
            }
            Err(_) => return Err(Error::Transient(error)),
            Ok((
                RolledBack::Replaced {
                    later_writes_refused,
                },
                session,
            )) => (session, later_writes_refused),
        };
        // The body ended the inbox's transaction itself before it failed.
        Err(Error::Inbox(
            ended_by_body(session, Some(claim), later_writes_refused).await,
        ))
    }

    /// [`finish_storing`](Self::finish_storing), with `as_error` to look into the handler's error.
    pub(crate) async fn finish_storing_after<T: Serialize, E>(
        mut self,
        result: Result<T, E>,
        as_error: impl for<'a> FnOnce(&'a E) -> Option<&'a (dyn std::error::Error + 'static)>,
    ) -> Result<Handled<T>, Error<E>> {
        if let Ok(value) = &result {
            let response = serde_json::to_vec(value).map_err(|error| {
                Error::Inbox(InboxError::Response {
                    source: error.into(),
                })
            })?;
            self.store_response(&response).await?;
        }
        self.finish_after(result, as_error).await
    }
}

impl<DB: Backend> fmt::Debug for Claimed<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Claimed")
            .field("consumer", &self.consumer())
            .field("key", self.key())
            .finish_non_exhaustive()
    }
}
