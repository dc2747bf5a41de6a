//! Many messages in one transaction: one statement claims all their keys, the body runs for the
//! new ones only, one commit.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use crate::error::{Error, InboxError, Stage};
use crate::inbox::{Handled, Inbox, check_consumer, commit};
use crate::key::{MessageKey, StableKey, message_key};
use crate::metrics::{Metrics, Outcome};
use crate::store::{Backend, database_error};
use crate::transaction::{BeginError, InboxTransaction};

/// A transaction holding the claims of a batch of keys; see [`Inbox::claim_batch`].
pub struct ClaimedBatch<DB: Backend> {
    tx: InboxTransaction<DB>,
    consumer: Box<str>,
    new: Vec<bool>,
    metrics: Arc<Metrics>,
}

impl<DB: Backend> ClaimedBatch<DB> {
    /// Whether the key at `index` (in the order given to `claim_batch`) was claimed by this batch:
    /// `false` for keys processed before, and for a repeat of a key earlier in the same batch.
    pub fn is_new(&self, index: usize) -> bool {
        self.new.get(index).copied().unwrap_or(false)
    }

    /// The transaction's connection, for the handlers' own statements.
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
        let inserted: HashSet<Vec<u8>> =
            DB::claim_batch(tx.connection(), &self.config.statements, consumer, &sorted)
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
