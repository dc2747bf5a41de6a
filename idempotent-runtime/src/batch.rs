//! Many messages in one transaction: one statement claims all their keys, the body runs for the
//! new ones only, one commit.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use crate::error::{Error, InboxError, Stage};
use crate::inbox::{Handled, Inbox, check_consumer, commit};
use crate::key::{MessageKey, StableKey, message_key};
use crate::metrics::{Metrics, Outcome};
use crate::store::{Backend, database_error, fault_of};
use crate::transaction::{BeginError, InboxTransaction};

/// A transaction holding the claims of a batch of keys; see [`Inbox::claim_batch`].
pub struct ClaimedBatch<DB: Backend> {
    tx: InboxTransaction<DB>,
    consumer: Box<str>,
    new: Vec<bool>,
    metrics: Arc<Metrics>,
}

impl<DB: Backend> ClaimedBatch<DB> {
    /// Returns whether the key at `index` (in the order given to `claim_batch`) was claimed by this
    /// batch: `false` for keys processed before, and for a repeat of a key earlier in the same
    /// batch.
    pub fn is_new(&self, index: usize) -> bool {
        self.new.get(index).copied().unwrap_or(false)
    }

    /// Returns the transaction's connection, for the handlers' own statements.
    pub fn connection(&mut self) -> &mut DB::Connection {
        self.tx.connection()
    }

    /// Commits the batch's work and claims together, if the transaction is still the one the
    /// batch began and nothing in it failed (see [`Claimed::commit`](crate::Claimed::commit)).
    pub async fn commit(self) -> Result<(), InboxError> {
        let claimed = self.new.iter().filter(|new| **new).count() as u64;
        commit(self.tx, None).await?;
        self.metrics
            .message(&self.consumer, Outcome::Processed, claimed);
        Ok(())
    }

    /// Marks where the body of the message at `index` begins, for [`undo`](Self::undo): a
    /// savepoint, one round trip, which is never released (the batch's commit commits what
    /// follows it, and a release would cost a round trip more per message).
    pub(crate) async fn mark(&mut self, index: usize) -> Result<(), InboxError> {
        let savepoint = format!("SAVEPOINT idempotent_message_{index}");
        DB::run(self.tx.connection(), &savepoint)
            .await
            .map_err(database_error(Stage::Claim))?;
        Ok(())
    }

    /// The body of the message at `index` (its key is `key`) failed: rolls back to its
    /// [`mark`](Self::mark) and gives up its claim, so that the batch commits without it and a
    /// redelivery finds its key free.
    pub(crate) async fn undo(
        &mut self,
        index: usize,
        statements: &crate::store::Statements,
        consumer: &str,
        key: &MessageKey,
    ) -> Result<(), InboxError> {
        let rollback = format!("ROLLBACK TO SAVEPOINT idempotent_message_{index}");
        DB::run(self.tx.connection(), &rollback)
            .await
            .map_err(database_error(Stage::Claim))?;
        DB::forget_claim(
            self.tx.connection(),
            &statements.inbox,
            consumer,
            key.as_bytes(),
        )
        .await
        .map_err(database_error(Stage::Claim))?;
        self.new[index] = false;
        self.metrics.message(&self.consumer, Outcome::RolledBack, 1);
        Ok(())
    }

    /// Rolls back the batch's work and claims.
    pub async fn rollback(self) {
        self.metrics.message(&self.consumer, Outcome::RolledBack, 1);
        let _ = self.tx.rollback().await;
    }
}

impl<DB: Backend> fmt::Debug for ClaimedBatch<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClaimedBatch")
            .field("new", &self.new)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Inbox<DB> {
    /// Begins one transaction and claims all `keys` for `consumer` in one statement (MySQL: one
    /// per key, as it has no `INSERT … RETURNING`). Keys are claimed sorted and without repeats, so
    /// two batches with overlapping keys wait for each other rather than deadlock.
    pub async fn claim_batch(
        &self,
        consumer: &str,
        keys: &[MessageKey],
    ) -> Result<ClaimedBatch<DB>, InboxError> {
        check_consumer(consumer)?;
        let mut sorted: Vec<&[u8]> = keys.iter().map(MessageKey::as_bytes).collect();
        sorted.sort_unstable();
        sorted.dedup();
        let mut tx =
            InboxTransaction::begin(self.resources())
                .await
                .map_err(|error| match error {
                    BeginError::Acquire(error) | BeginError::Begin(error) => {
                        database_error(Stage::Begin)(error)
                    }
                })?;
        let inserted: HashSet<Vec<u8>> = DB::claim_batch(
            tx.connection(),
            &self.config.statements.inbox,
            consumer,
            &sorted,
        )
        .await
        .map_err(database_error(Stage::Claim))?
        .into_iter()
        .collect();
        // A key repeated in the batch is new only the first time.
        let mut seen = HashSet::new();
        let new: Vec<bool> = keys
            .iter()
            .map(|key| inserted.contains(key.as_bytes()) && seen.insert(key.as_bytes()))
            .collect();
        let duplicates = new.iter().filter(|new| !**new).count();
        self.metrics
            .message(consumer, Outcome::Duplicate, duplicates as u64);
        tracing::debug!(
            consumer,
            keys = keys.len(),
            claimed = keys.len() - duplicates,
            "claimed a batch"
        );
        Ok(ClaimedBatch {
            tx,
            consumer: consumer.into(),
            new,
            metrics: self.metrics.clone(),
        })
    }

    /// Handles `messages` in one transaction: claims all their keys in one statement, runs `body`
    /// for each message whose key is new, in order, and commits once. The outcome of each message
    /// comes back in order: `Processed` with the body's value, or `Duplicate`. When a body returns
    /// an error, the whole batch rolls back and nothing is recorded, so the redelivered messages run
    /// again; an empty key fails the batch before any work.
    pub async fn handle_batch<M, K, T, E, F>(
        &self,
        consumer: &str,
        messages: &[M],
        key: impl Fn(&M) -> &K,
        mut body: F,
    ) -> Result<Vec<Handled<T>>, Error<E>>
    where
        K: StableKey + ?Sized,
        F: AsyncFnMut(&mut DB::Connection, &M) -> Result<T, E>,
    {
        let keys = messages
            .iter()
            .map(|message| message_key(key(message)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|error| Error::Inbox(InboxError::Key(error)))?;
        let mut batch = self.claim_batch(consumer, &keys).await?;
        let mut outcomes = Vec::with_capacity(messages.len());
        for (index, (message, key)) in messages.iter().zip(keys).enumerate() {
            if !batch.is_new(index) {
                outcomes.push(Handled::Duplicate {
                    consumer: consumer.to_owned(),
                    key,
                    response: None,
                });
                continue;
            }
            match body(batch.connection(), message).await {
                Ok(value) => outcomes.push(Handled::Processed(value)),
                Err(error) => {
                    batch.rollback().await;
                    return Err(Error::Handler(error));
                }
            }
        }
        batch.commit().await?;
        Ok(outcomes)
    }
}

/// The outcome of one message of a batch handled by [`Inbox::handle_batch_each`].
pub type BatchOutcome<T, E> = Result<Handled<T>, Error<E>>;

impl<DB: Backend> Inbox<DB> {
    /// Handles `messages` in one transaction, each with its own outcome: claims all their keys in
    /// one statement, runs `body` for each message whose key is new, in order, each after a
    /// savepoint of its own, and commits once. A body that fails rolls back only its own
    /// savepoint and gives up its claim, so its message is not recorded and a redelivery runs it
    /// again, while the others commit: one failing message does not fail, or redeliver, the rest.
    /// Its outcome is [`Error::Transient`] when the database failed under it (found in the error's
    /// sources), [`Error::Handler`] otherwise; a message with an empty key gets
    /// [`InboxError::Key`]. The whole call fails only when the batch's claim or commit does: then
    /// nothing of it is recorded.
    ///
    /// On PostgreSQL each savepoint followed by a write is a subtransaction: keep batches under 64
    /// messages, past which PostgreSQL's snapshots slow down in every session (the
    /// subtransaction cache of a transaction overflows).
    pub async fn handle_batch_each<M, K, T, E, F>(
        &self,
        consumer: &str,
        messages: &[M],
        key: impl Fn(&M) -> &K,
        mut body: F,
    ) -> Result<Vec<BatchOutcome<T, E>>, InboxError>
    where
        K: StableKey + ?Sized,
        E: std::error::Error + 'static,
        F: AsyncFnMut(&mut DB::Connection, &M) -> Result<T, E>,
    {
        let keys: Vec<_> = messages.iter().map(|m| message_key(key(m))).collect();
        let valid: Vec<MessageKey> = keys.iter().filter_map(|k| k.clone().ok()).collect();
        let mut batch = self.claim_batch(consumer, &valid).await?;
        let statements = &self.config.statements;
        let mut outcomes = Vec::with_capacity(messages.len());
        let mut claimed = 0;
        for (message, key) in messages.iter().zip(keys) {
            let key = match key {
                Ok(key) => key,
                Err(error) => {
                    outcomes.push(Err(Error::Inbox(InboxError::Key(error))));
                    continue;
                }
            };
            let index = claimed;
            claimed += 1;
            if !batch.is_new(index) {
                outcomes.push(Ok(Handled::Duplicate {
                    consumer: consumer.to_owned(),
                    key,
                    response: None,
                }));
                continue;
            }
            batch.mark(index).await?;
            match body(batch.connection(), message).await {
                Ok(value) => outcomes.push(Ok(Handled::Processed(value))),
                Err(error) => {
                    batch.undo(index, statements, consumer, &key).await?;
                    outcomes.push(Err(Error::of_body(error, |e| fault_of(e))));
                }
            }
        }
        batch.commit().await?;
        Ok(outcomes)
    }
}
