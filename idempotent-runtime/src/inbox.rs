//! The inbox: a pool, a table, and the claim that begins each handler's transaction.

use std::fmt;

use sqlx::{Pool, Transaction};

use crate::error::{Error, InboxError, Stage};
use crate::key::{MessageKey, StableKey, message_key};
use crate::store::{Backend, HandlerConnection, Statements};
use crate::table::TableName;

/// The longest consumer name accepted, in bytes.
pub const MAX_CONSUMER_LEN: usize = 200;

/// The record of which messages each consumer has processed, in one table of the database the
/// handlers write to.
///
/// Cheap to clone (it holds a pool); make one per database and share it.
pub struct Inbox<DB: Backend> {
    pool: Pool<DB>,
    table: TableName,
    statements: Statements,
}

/// The inbox a handler taking a `&mut C` connection is rewritten to take:
/// `InboxFor<sqlx::PgConnection>` is `Inbox<sqlx::Postgres>`.
pub type InboxFor<C> = Inbox<<C as HandlerConnection>::Backend>;

impl<DB: Backend> Inbox<DB> {
    /// An inbox in the table `idempotent_inbox` of `pool`'s database. Call [`migrate`](Self::migrate)
    /// once at start-up to create the table.
    pub fn new(pool: Pool<DB>) -> Self {
        let table = TableName::default();
        Self {
            statements: DB::statements(&table),
            pool,
            table,
        }
    }

    /// The same inbox in another table; `name` must pass [`TableName::new`].
    pub fn with_table(self, name: &str) -> Result<Self, InboxError> {
        let table = TableName::new(name)?;
        Ok(Self {
            statements: DB::statements(&table),
            pool: self.pool,
            table,
        })
    }

    /// The pool the inbox runs on.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The inbox table's name.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// Creates the inbox table and its index if they are missing. Idempotent, and safe to call
    /// from every instance at start-up.
    pub async fn migrate(&self) -> Result<(), InboxError> {
        DB::migrate(&self.pool, &self.table)
            .await
            .map_err(InboxError::database(Stage::Migrate))
    }

    /// Begins a transaction and claims `key` for `consumer` in it: `Some` with the open transaction
    /// when this call claimed the key, `None` when the key was already processed (the transaction is
    /// rolled back). Waits while another transaction holds an uncommitted claim on the same key.
    ///
    /// This is what `#[idempotent]` calls; use it directly to make a handler idempotent by hand.
    /// Dropping the returned [`Claimed`] without committing rolls everything back.
    pub async fn claim(
        &self,
        consumer: &str,
        key: &MessageKey,
    ) -> Result<Option<Claimed<DB>>, InboxError> {
        check_consumer(consumer)?;
        let mut tx = DB::begin(&self.pool)
            .await
            .map_err(InboxError::database(Stage::Begin))?;
        let claimed = DB::claim(&mut tx, &self.statements, consumer, key.as_bytes())
            .await
            .map_err(InboxError::database(Stage::Claim))?;
        if claimed {
            tracing::debug!(consumer, key = %key, "claimed message key");
            Ok(Some(Claimed { tx }))
        } else {
            tracing::debug!(consumer, key = %key, "duplicate message key");
            rollback(tx).await;
            Ok(None)
        }
    }

    /// Whether the inbox records `key` as processed by `consumer` (committed claims only).
    pub async fn is_processed<K: StableKey + ?Sized>(
        &self,
        consumer: &str,
        key: &K,
    ) -> Result<bool, InboxError> {
        let key = message_key(key)?;
        DB::contains(&self.pool, &self.statements, consumer, key.as_bytes())
            .await
            .map_err(InboxError::database(Stage::Inspect))
    }
}

impl<DB: Backend> Clone for Inbox<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            table: self.table.clone(),
            statements: self.statements.clone(),
        }
    }
}

impl<DB: Backend> fmt::Debug for Inbox<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inbox")
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

fn check_consumer(consumer: &str) -> Result<(), InboxError> {
    let reason = if consumer.is_empty() {
        "it is empty"
    } else if consumer.len() > MAX_CONSUMER_LEN {
        "it is longer than 200 bytes"
    } else {
        return Ok(());
    };
    Err(InboxError::ConsumerName {
        name: consumer.to_owned(),
        reason,
    })
}

async fn rollback<DB: Backend>(tx: Transaction<'static, DB>) {
    // A failed rollback means the connection is broken; sqlx closes it instead of reusing it, and
    // the server rolls back when the session ends.
    if let Err(error) = tx.rollback().await {
        tracing::warn!(%error, "rollback failed; the connection is discarded");
    }
}

/// A transaction in which this caller holds the claim on a message key. Run the handler's work on
/// [`connection`](Self::connection), then [`commit`](Self::commit) to record the effect and the key
/// together. Dropping it (a panic, a cancelled future) rolls back, so the key stays unclaimed.
pub struct Claimed<DB: Backend> {
    tx: Transaction<'static, DB>,
}

impl<DB: Backend> Claimed<DB> {
    /// The transaction's connection, for the handler's own statements.
    pub fn connection(&mut self) -> &mut DB::Connection {
        &mut self.tx
    }

    /// Commits the handler's work and the claim together.
    pub async fn commit(self) -> Result<(), InboxError> {
        self.tx
            .commit()
            .await
            .map_err(InboxError::database(Stage::Commit))
    }

    /// Rolls back the handler's work and the claim: a redelivery will run the handler again.
    pub async fn rollback(self) {
        rollback(self.tx).await
    }

    /// Commits on `Ok`, rolls back on `Err`: the end of every rewritten handler.
    pub async fn finish<T, E>(self, result: Result<T, E>) -> Result<Handled<T>, Error<E>> {
        match result {
            Ok(value) => {
                self.commit().await?;
                Ok(Handled::Processed(value))
            }
            Err(error) => {
                self.rollback().await;
                Err(Error::Handler(error))
            }
        }
    }
}

impl<DB: Backend> fmt::Debug for Claimed<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Claimed").finish_non_exhaustive()
    }
}

/// What a call of an idempotent handler did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "acknowledge the message on either outcome"]
pub enum Handled<T> {
    /// This call ran the body and committed its effect; here is what the body returned.
    Processed(T),
    /// The key was already processed by this consumer: the body did not run and nothing changed.
    /// Acknowledge the message.
    Duplicate {
        /// The consumer that had processed it.
        consumer: String,
        /// The message's key, as stored.
        key: MessageKey,
    },
}

impl<T> Handled<T> {
    /// Whether this call ran the body.
    pub fn is_processed(&self) -> bool {
        matches!(self, Handled::Processed(_))
    }

    /// Whether the message had been processed before.
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Handled::Duplicate { .. })
    }

    /// The body's value, if this call ran it.
    pub fn processed(self) -> Option<T> {
        match self {
            Handled::Processed(value) => Some(value),
            Handled::Duplicate { .. } => None,
        }
    }
}
