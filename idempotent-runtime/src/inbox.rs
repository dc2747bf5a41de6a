//! The inbox: a pool, a table, and the claim that begins each handler's transaction.

use std::fmt;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::Pool;
use tokio::sync::Semaphore;

use crate::error::{Error, InboxError, Stage};
use crate::key::{IdempotencyKey, MessageKey, StableKey, message_key};
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::retention::Retention;
use crate::store::{Backend, HandlerConnection, Statements};
use crate::table::TableName;
use crate::transaction::{BeginError, InboxTransaction, Kept, Resources};

/// The longest consumer name accepted, in bytes.
pub const MAX_CONSUMER_LEN: usize = 200;

/// The record of which messages each consumer has processed, in one table of the database the
/// handlers write to.
///
/// Cheap to clone (it holds a pool and shares its configuration and counters); make one per
/// database and share it.
pub struct Inbox<DB: Backend> {
    pub(crate) pool: Pool<DB>,
    pub(crate) table: TableName,
    pub(crate) statements: Arc<Statements>,
    pub(crate) retention: Arc<Retention>,
    pub(crate) metrics: Arc<Metrics>,
    /// The connection a worker's inbox keeps between transactions ([`Inbox::for_worker`]).
    pub(crate) kept: Option<Kept<DB>>,
    /// The queue of this inbox's writers, on a database with one writer at a time.
    pub(crate) writers: Option<Arc<Semaphore>>,
}

/// The inbox a handler taking a `&mut C` connection is rewritten to take:
/// `InboxFor<sqlx::PgConnection>` is `Inbox<sqlx::Postgres>`.
pub type InboxFor<C> = Inbox<<C as HandlerConnection>::Backend>;

/// What a claim checks besides the key: see [`Inbox::claim_with`].
#[derive(Debug, Clone, Copy, Default)]
pub struct ClaimOptions<'a> {
    /// The message's payload fingerprint: stored with the claim; a duplicate whose stored
    /// fingerprint differs is an [`InboxError::FingerprintMismatch`].
    pub fingerprint: Option<&'a [u8]>,
    /// Read the stored response of a duplicate.
    pub read_response: bool,
}

/// What a claim found.
pub enum Claim<DB: Backend> {
    /// The key is ours: run the handler's work in this transaction.
    New(Claimed<DB>),
    /// The key was processed before.
    Duplicate {
        /// The response stored by the first call, when asked for and stored.
        response: Option<Vec<u8>>,
    },
}

impl<DB: Backend> Inbox<DB> {
    /// An inbox in the table `idempotent_inbox` of `pool`'s database, keeping rows for the
    /// [default retention](Retention::DEFAULT). Call [`migrate`](Self::migrate) once at start-up to
    /// create the tables.
    pub fn new(pool: Pool<DB>) -> Self {
        let table = TableName::default();
        Self {
            statements: Arc::new(Statements::new(DB::DIALECT, &table)),
            pool,
            table,
            retention: Arc::new(Retention::default()),
            metrics: Arc::default(),
            kept: None,
            writers: DB::ONE_WRITER.then(|| Arc::new(Semaphore::new(1))),
        }
    }

    /// The same inbox for one worker that handles messages one after another: it keeps the
    /// connection of each transaction that ended cleanly and begins the next one on it, instead of
    /// handing it back to the pool and taking one again. sqlx checks a connection with a round trip
    /// each time it goes back to the pool and, unless the pool was built with
    /// `test_before_acquire(false)`, each time it is taken; keeping it saves both.
    ///
    /// The kept connection stays out of the pool until the worker's inbox (and its clones, which
    /// share it) is dropped, so size the pool for one connection per worker plus what the rest of
    /// the program uses. Concurrent calls on one worker's inbox are still correct: one of them
    /// takes the kept connection, the others take connections from the pool. A kept connection
    /// that broke (the server restarted) fails the next call with a retryable error and is
    /// dropped; the call after that takes a fresh one.
    ///
    /// ```no_run
    /// # async fn demo(inbox: idempotent_runtime::Inbox<sqlx::Postgres>) {
    /// for _ in 0..4 {
    ///     let inbox = inbox.for_worker();
    ///     tokio::spawn(async move {
    ///         // receive messages and call the handlers with `&inbox`, one at a time
    ///         # drop(inbox);
    ///     });
    /// }
    /// # }
    /// ```
    pub fn for_worker(&self) -> Self {
        Self {
            kept: Some(Kept::default()),
            ..self.clone()
        }
    }

    /// The same inbox in another table; `name` must pass [`TableName::new`].
    pub fn with_table(self, name: &str) -> Result<Self, InboxError> {
        let table = TableName::new(name)?;
        let mut statements = Statements::new(DB::DIALECT, &table);
        statements.separate_claim = self.statements.separate_claim;
        Ok(Self {
            statements: Arc::new(statements),
            table,
            ..self
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

    /// What this inbox (and its clones) counted so far.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.metrics.snapshot()
    }

    /// Creates the inbox table, its calls table and their index if they are missing. Idempotent,
    /// and safe to call from every instance at start-up.
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
        match self
            .claim_with(consumer, key, ClaimOptions::default())
            .await?
        {
            Claim::New(claimed) => Ok(Some(claimed)),
            Claim::Duplicate { .. } => Ok(None),
        }
    }

    /// [`claim`](Self::claim), checking a payload fingerprint and reading a stored response.
    pub async fn claim_with(
        &self,
        consumer: &str,
        key: &MessageKey,
        options: ClaimOptions<'_>,
    ) -> Result<Claim<DB>, InboxError> {
        check_consumer(consumer)?;
        let span = tracing::Span::current();
        if !span.is_disabled() {
            span.record("key", tracing::field::display(key.digest()));
        }
        let claimed = InboxTransaction::claim(
            self.resources(),
            &self.statements,
            consumer,
            key.as_bytes(),
            options.fingerprint,
        )
        .await
        .map_err(|error| match error {
            BeginError::Acquire(error) => InboxError::database(Stage::Begin)(error),
            BeginError::Claim(error) => InboxError::database(Stage::Claim)(error),
        })?;
        if let Some(tx) = claimed {
            tracing::debug!(consumer, key = %key.digest(), "claimed message key");
            return Ok(Claim::New(Claimed {
                tx,
                consumer: consumer.into(),
                key: key.clone(),
                statements: self.statements.clone(),
                metrics: self.metrics.clone(),
            }));
        }
        self.metrics.duplicate(1);
        tracing::Span::current().record("outcome", "duplicate");
        tracing::info!(consumer, key = %key.digest(), "duplicate message: already processed");
        if options.fingerprint.is_none() && !options.read_response {
            return Ok(Claim::Duplicate { response: None });
        }
        let (response, stored_fingerprint) =
            DB::stored(&self.pool, &self.statements, consumer, key.as_bytes())
                .await
                .map_err(InboxError::database(Stage::Inspect))?
                .unwrap_or_default();
        if let (Some(ours), Some(theirs)) = (options.fingerprint, stored_fingerprint.as_deref())
            && ours != theirs
        {
            self.metrics.fingerprint_mismatch(1);
            tracing::warn!(consumer, key = %key.digest(), "same message key, different payload");
            return Err(InboxError::FingerprintMismatch {
                consumer: consumer.to_owned(),
                key: key.clone(),
            });
        }
        Ok(Claim::Duplicate { response })
    }

    /// What its transactions need besides the statements.
    pub(crate) fn resources(&self) -> Resources<'_, DB> {
        Resources {
            pool: &self.pool,
            kept: self.kept.as_ref(),
            writers: self.writers.as_ref(),
        }
    }

    /// Whether the inbox records `key` as processed by `consumer` (committed claims only).
    pub async fn is_processed<K: StableKey + ?Sized>(
        &self,
        consumer: &str,
        key: &K,
    ) -> Result<bool, InboxError> {
        let key = message_key(key)?;
        let row = DB::stored(&self.pool, &self.statements, consumer, key.as_bytes())
            .await
            .map_err(InboxError::database(Stage::Inspect))?;
        Ok(row.is_some())
    }
}

impl<DB: Backend> Clone for Inbox<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            table: self.table.clone(),
            statements: self.statements.clone(),
            retention: self.retention.clone(),
            metrics: self.metrics.clone(),
            kept: self.kept.clone(),
            writers: self.writers.clone(),
        }
    }
}

impl<DB: Backend> fmt::Debug for Inbox<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inbox")
            .field("table", &self.table)
            .field("retention", &self.retention)
            .field("for_worker", &self.kept.is_some())
            .finish_non_exhaustive()
    }
}

pub(crate) fn check_consumer(consumer: &str) -> Result<(), InboxError> {
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

/// A transaction in which this caller holds the claim on a message key. Run the handler's work on
/// [`connection`](Self::connection), then [`commit`](Self::commit) to record the effect and the key
/// together. Dropping it (a panic, a cancelled future) rolls back, so the key stays unclaimed.
pub struct Claimed<DB: Backend> {
    tx: InboxTransaction<DB>,
    consumer: Box<str>,
    key: MessageKey,
    statements: Arc<Statements>,
    metrics: Arc<Metrics>,
}

impl<DB: Backend> Claimed<DB> {
    /// The transaction's connection, for the handler's own statements.
    pub fn connection(&mut self) -> &mut DB::Connection {
        self.tx.connection()
    }

    /// The claimed key.
    pub fn key(&self) -> &MessageKey {
        &self.key
    }

    /// The key to pass on to an outside service that deduplicates by idempotency key; the same on
    /// every delivery of this message to this consumer.
    pub fn idempotency_key(&self) -> IdempotencyKey {
        IdempotencyKey::new(&self.consumer, &self.key)
    }

    /// Commits the handler's work and the claim together.
    pub async fn commit(self) -> Result<(), InboxError> {
        let (consumer, key) = (self.consumer, self.key);
        match self.tx.commit().await {
            Ok(()) => {
                self.metrics.processed(1);
                tracing::Span::current().record("outcome", "processed");
                tracing::debug!(%consumer, key = %key.digest(), "committed");
                Ok(())
            }
            Err(error) => {
                self.metrics.rolled_back(1);
                tracing::Span::current().record("outcome", "commit failed");
                tracing::warn!(%consumer, key = %key.digest(), %error, "commit failed");
                Err(InboxError::database(Stage::Commit)(error))
            }
        }
    }

    /// Rolls back the handler's work and the claim: a redelivery will run the handler again.
    pub async fn rollback(self) {
        self.metrics.rolled_back(1);
        tracing::Span::current().record("outcome", "rolled back");
        tracing::debug!(consumer = %self.consumer, key = %self.key.digest(), "rolled back");
        self.tx.rollback().await
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

    /// [`finish`](Self::finish), storing the `Ok` value (as JSON) with the inbox row, so that a
    /// duplicate can return it.
    pub async fn finish_storing<T: Serialize, E>(
        mut self,
        result: Result<T, E>,
    ) -> Result<Handled<T>, Error<E>> {
        if let Ok(value) = &result {
            let response = serde_json::to_vec(value).map_err(|error| {
                Error::Inbox(InboxError::Response {
                    source: error.into(),
                })
            })?;
            DB::set_response(
                self.tx.connection(),
                &self.statements,
                &self.consumer,
                self.key.as_bytes(),
                &response,
            )
            .await
            .map_err(|error| Error::Inbox(InboxError::database(Stage::Claim)(error)))?;
        }
        self.finish(result).await
    }
}

impl<DB: Backend> fmt::Debug for Claimed<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Claimed")
            .field("consumer", &self.consumer)
            .field("key", &self.key)
            .finish_non_exhaustive()
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
        /// What the first call returned, for handlers with `store_response`; `None` otherwise, and
        /// for rows stored without a response.
        response: Option<T>,
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

    /// The body's value: this call's, or the first call's stored response.
    pub fn value(self) -> Option<T> {
        match self {
            Handled::Processed(value) => Some(value),
            Handled::Duplicate { response, .. } => response,
        }
    }
}

/// Decodes a stored response.
pub(crate) fn decode_response<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, InboxError> {
    serde_json::from_slice(bytes).map_err(|error| InboxError::Response {
        source: error.into(),
    })
}
