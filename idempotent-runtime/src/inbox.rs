//! The inbox: a pool, a table, and the claim that begins each handler's transaction.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::Pool;
use tokio::sync::Semaphore;

use crate::error::{Error, Fault, InboxError, Stage};
use crate::key::{AsMessageKey, IdempotencyKey, MessageKey};
use crate::metrics::{Metrics, MetricsSnapshot, Outcome};
use crate::outbox::message::{self as outgoing, Outbox};
use crate::retention::{self, Expired, PurgeReport, Purger, PurgerOptions, Retention};
use crate::schema::{self, Migration};
use crate::session::{Session, Source, Spares, Worker};
use crate::store::{
    Backend, Ending, HandlerConnection, RolledBack, Statements, StoredRow, database_error, fault_of,
};
use crate::table::TableName;
use crate::transaction::{BeginError, ClaimOutcome, InboxTransaction, Resources};

/// The longest consumer name accepted, in bytes.
pub const MAX_CONSUMER_LEN: usize = 200;

/// The record of which messages each consumer has processed, in one table of the database the
/// handlers write to.
///
/// Cheap to clone (it holds a pool and shares its configuration and counters); make one per
/// database and share it.
pub struct Inbox<DB: Backend> {
    pool: Pool<DB>,
    pub(crate) config: Arc<Config<DB>>,
    pub(crate) metrics: Arc<Metrics>,
    /// The connections this inbox's workers keep between transactions.
    spares: Arc<Spares<DB>>,
    /// Set in a worker's inbox ([`Inbox::for_worker`]): it keeps its connections as spares.
    worker: Option<Arc<Worker<DB>>>,
    /// The queue of this inbox's writers, on a database with one writer at a time.
    writers: Option<Arc<Semaphore>>,
    /// The keys the HTTP layers made from this inbox are handling.
    #[cfg(feature = "http")]
    pub(crate) in_flight: Arc<crate::in_flight::InFlight>,
}

/// What an inbox is configured with; shared by its clones, replaced whole by the `with_…`
/// methods.
pub(crate) struct Config<DB: Backend> {
    pub(crate) table: TableName,
    pub(crate) statements: Statements,
    pub(crate) settings: DB::Settings,
    pub(crate) retention: Retention,
}

// Not derived: that would ask for `DB: Clone`.
impl<DB: Backend> Clone for Config<DB> {
    fn clone(&self) -> Self {
        Self {
            table: self.table.clone(),
            statements: self.statements.clone(),
            settings: self.settings.clone(),
            retention: self.retention.clone(),
        }
    }
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
    /// When the message was sent, if it says (a key that is a UUIDv7 says it without this): a new
    /// key of a message sent before its consumer's purge horizon is refused with
    /// [`InboxError::OlderThanHorizon`]. See [`Retention`] for the horizon.
    pub sent_at: Option<SystemTime>,
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
            config: Arc::new(Config {
                statements: Statements::new(DB::DIALECT, &table),
                table,
                settings: DB::Settings::default(),
                retention: Retention::default(),
            }),
            pool,
            metrics: Arc::default(),
            spares: Arc::default(),
            worker: None,
            writers: DB::ONE_WRITER.then(|| Arc::new(Semaphore::new(1))),
            #[cfg(feature = "http")]
            in_flight: Arc::default(),
        }
    }

    /// The same inbox for one worker that handles messages one after another: it keeps the
    /// connection of each transaction that ended cleanly and begins the next one on it, instead of
    /// handing it back to the pool and taking one again. sqlx checks a connection with a round trip
    /// each time it goes back to the pool and, unless the pool was built with
    /// `test_before_acquire(false)`, each time it is taken; keeping it saves both. The worker's
    /// reads (a duplicate's stored response, [`is_processed`](Self::is_processed)) use it too.
    ///
    /// The workers of one inbox share the connections they keep: a worker takes any kept
    /// connection before it asks the pool, and while a worker of the inbox waits for the pool the
    /// others give their connections back to it instead of keeping them, so more workers than the
    /// pool has connections take turns rather than starve. Size the pool for one connection per
    /// worker plus what the rest of the program uses. The kept connections go back to the pool
    /// when the last worker's inbox (and its clones) is dropped. A kept connection that broke (the
    /// server restarted) fails the next call with a retryable error and is dropped; the call after
    /// that takes a fresh one. Kept connections are not subject to the pool's `max_lifetime` and
    /// `idle_timeout` while they are kept.
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
            worker: Some(Worker::new(&self.spares)),
            ..self.clone()
        }
    }

    /// The same inbox in another table; `name` must pass [`TableName::new`].
    pub fn with_table(self, name: &str) -> Result<Self, InboxError> {
        let table = TableName::new(name)?;
        Ok(self.with_config(|config| Config {
            statements: Statements::new(DB::DIALECT, &table).with_pooling(config.statements.pooled),
            table,
            ..config.clone()
        }))
    }

    /// The same inbox with its configuration replaced by `change`'s.
    pub(crate) fn with_config(self, change: impl FnOnce(&Config<DB>) -> Config<DB>) -> Self {
        Self {
            config: Arc::new(change(&self.config)),
            ..self
        }
    }

    /// The same inbox with its backend's settings replaced by `change`'s.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn with_settings(self, change: impl FnOnce(&DB::Settings) -> DB::Settings) -> Self {
        self.with_config(|config| Config {
            settings: change(&config.settings),
            ..config.clone()
        })
    }

    /// The pool the inbox runs on.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// The inbox table's name.
    pub fn table(&self) -> &TableName {
        &self.config.table
    }

    /// What this inbox (and its clones) counted so far.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.metrics.snapshot()
    }

    /// Creates the inbox's tables if they are missing, and upgrades tables made by an older
    /// version of this library (see [`schema`](crate::schema)); refuses tables of a newer one with
    /// [`InboxError::SchemaTooNew`]. Idempotent, and safe to call from every instance at start-up:
    /// concurrent migrations wait for each other.
    ///
    /// On PostgreSQL it first checks that no pooler in transaction mode (PgBouncer's
    /// `pool_mode = transaction`) sits between the pool and the database, unless the inbox was
    /// made for one with [`with_transaction_pooling`](Inbox::with_transaction_pooling): if one
    /// does, it fails with [`InboxError::TransactionPooling`] rather than let the inbox's prepared
    /// statements fail message by message.
    pub async fn migrate(&self) -> Result<Migration, InboxError> {
        let pooled = !self.config.statements.pooled
            && DB::transaction_pooled(&self.pool)
                .await
                .map_err(database_error(Stage::Migrate))?;
        if pooled {
            return Err(InboxError::TransactionPooling);
        }
        let source = Source {
            keeps: false,
            ..self.source()
        };
        schema::migrate(source, &self.config.statements, &self.config.table).await
    }

    /// Begins a transaction and claims `key` for `consumer` in it: `Some` with the open transaction
    /// when this call claimed the key, `None` when the key was already processed (the transaction is
    /// rolled back). Waits while another transaction holds an uncommitted claim on the same key.
    /// `key` is a [`MessageKey`] or any [`StableKey`](crate::StableKey) value.
    ///
    /// This is what `#[idempotent]` calls; use it directly to make a handler idempotent by hand.
    /// Dropping the returned [`Claimed`] without committing rolls everything back.
    pub async fn claim<K: AsMessageKey + ?Sized>(
        &self,
        consumer: &str,
        key: &K,
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
    pub async fn claim_with<K: AsMessageKey + ?Sized>(
        &self,
        consumer: &str,
        key: &K,
        options: ClaimOptions<'_>,
    ) -> Result<Claim<DB>, InboxError> {
        check_consumer(consumer)?;
        let key = key.as_message_key()?;
        let span = tracing::Span::current();
        if !span.is_disabled() {
            span.record("key", tracing::field::display(key.digest()));
        }
        let (claimed, waited) = InboxTransaction::begin_claim(
            self.resources(),
            &self.config.statements,
            &self.config.settings,
            consumer,
            key.as_bytes(),
            options.fingerprint,
        )
        .await
        .map_err(|error| match error {
            BeginError::Acquire(error) => database_error(Stage::Begin)(error),
            BeginError::Begin(error) => database_error(Stage::Claim)(error),
        })?;
        let claimed_new = matches!(claimed, ClaimOutcome::Claimed(_));
        self.metrics.claim_waited(consumer, claimed_new, waited);
        let mut session = match claimed {
            ClaimOutcome::Claimed(mut tx) => {
                if let Some(sent_at) = options.sent_at.or_else(|| key.sent_at()) {
                    let margin = self.config.retention.skew_margin;
                    let checked = retention::check_horizon::<DB>(
                        tx.connection(),
                        &self.config.statements,
                        consumer,
                        &key,
                        sent_at,
                        margin,
                    )
                    .await;
                    if let Err(error) = checked {
                        let _ = tx.rollback().await;
                        if matches!(error, InboxError::OlderThanHorizon { .. }) {
                            self.metrics.message(consumer, Outcome::OlderThanHorizon, 1);
                            tracing::warn!(consumer, key = %key.digest(), "message older than the purge horizon: refused");
                        }
                        return Err(error);
                    }
                }
                tracing::debug!(consumer, key = %key.digest(), "claimed message key");
                return Ok(Claim::New(Claimed::new(
                    tx,
                    consumer,
                    key.into_owned(),
                    self,
                )));
            }
            ClaimOutcome::Duplicate(session) => session,
        };
        self.metrics.message(consumer, Outcome::Duplicate, 1);
        tracing::Span::current().record("outcome", "duplicate");
        tracing::info!(consumer, key = %key.digest(), "duplicate message: already processed");
        if options.fingerprint.is_none() && !options.read_response {
            return Ok(Claim::Duplicate { response: None });
        }
        let statements = &self.config.statements;
        let StoredRow {
            response,
            fingerprint: stored_fingerprint,
        } = DB::stored(session.get(), &statements.inbox, consumer, key.as_bytes())
            .await
            .map_err(database_error(Stage::Inspect))?
            .unwrap_or_default();
        if let (Some(ours), Some(theirs)) = (options.fingerprint, stored_fingerprint.as_deref())
            && ours != theirs
        {
            self.metrics
                .message(consumer, Outcome::FingerprintMismatch, 1);
            tracing::warn!(consumer, key = %key.digest(), "same message key, different payload");
            return Err(InboxError::FingerprintMismatch {
                consumer: consumer.to_owned(),
                key: key.into_owned(),
            });
        }
        Ok(Claim::Duplicate { response })
    }

    /// Where its connections come from.
    pub(crate) fn source(&self) -> Source<'_, DB> {
        Source {
            pool: &self.pool,
            spares: &self.spares,
            keeps: self.worker.is_some(),
        }
    }

    /// What its transactions need besides the statements.
    pub(crate) fn resources(&self) -> Resources<'_, DB> {
        Resources {
            source: self.source(),
            writers: self.writers.as_ref(),
        }
    }

    /// Keeps rows for `retention` after they were processed (see [`Retention`] for the default and
    /// why), for every consumer without an override.
    pub fn with_retention(self, retention: Duration) -> Self {
        self.with_config(|config| Config {
            retention: Retention {
                default: retention,
                ..config.retention.clone()
            },
            ..config.clone()
        })
    }

    /// Keeps `consumer`'s rows for `retention`.
    pub fn with_consumer_retention(self, consumer: &str, retention: Duration) -> Self {
        self.with_config(|config| {
            let mut per_consumer = config.retention.per_consumer.clone();
            per_consumer.insert(consumer.to_owned(), retention);
            Config {
                retention: Retention {
                    per_consumer,
                    ..config.retention.clone()
                },
                ..config.clone()
            }
        })
    }

    /// Sets the margin for producers' clocks running ahead of the database's, when a message's
    /// send time is checked against its consumer's purge horizon; see
    /// [`Retention::skew_margin`].
    pub fn with_clock_skew_margin(self, margin: Duration) -> Self {
        self.with_config(|config| Config {
            retention: Retention {
                skew_margin: margin,
                ..config.retention.clone()
            },
            ..config.clone()
        })
    }

    /// How long rows are kept.
    pub fn retention(&self) -> &Retention {
        &self.config.retention
    }

    /// Deletes every expired row, `batch_size` rows per transaction, oldest first, using the index
    /// on `processed_at`; each batch is one short statement, so claims wait for at most one batch.
    /// Before it deletes a consumer's rows it records the consumer's purge horizon (see
    /// [`Retention`]); then it deletes the expired call records and audit rows the same way.
    /// Does nothing when another instance is purging the same table (PostgreSQL advisory lock,
    /// MySQL `GET_LOCK`). Dropped half-way (a timeout around it), it leaves nothing behind: its
    /// batch rolls back and the session holding the lock is closed.
    pub async fn purge_expired(&self, batch_size: usize) -> Result<PurgeReport, InboxError> {
        self.purge(batch_size, Duration::ZERO).await
    }

    async fn purge(&self, batch_size: usize, pause: Duration) -> Result<PurgeReport, InboxError> {
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

    /// What [`purge_expired`](Self::purge_expired) would delete now, per consumer, without
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
        retention::spawn(options, self.config.table.clone(), move |batch, pause| {
            let inbox = inbox.clone();
            Box::pin(async move { inbox.purge(batch, pause).await })
        })
    }

    /// Whether the inbox records `key` as processed by `consumer` (committed claims only). `key`
    /// is a [`MessageKey`] or any [`StableKey`](crate::StableKey) value.
    pub async fn is_processed<K: AsMessageKey + ?Sized>(
        &self,
        consumer: &str,
        key: &K,
    ) -> Result<bool, InboxError> {
        check_consumer(consumer)?;
        let key = key.as_message_key()?;
        let mut session = Session::take(self.source())
            .await
            .map_err(database_error(Stage::Inspect))?;
        let row = session
            .try_step(|conn| {
                DB::stored(
                    conn,
                    &self.config.statements.inbox,
                    consumer,
                    key.as_bytes(),
                )
            })
            .await
            .map_err(database_error(Stage::Inspect))?;
        Ok(row.is_some())
    }
}

impl<DB: Backend> Clone for Inbox<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            config: self.config.clone(),
            metrics: self.metrics.clone(),
            spares: self.spares.clone(),
            worker: self.worker.clone(),
            writers: self.writers.clone(),
            #[cfg(feature = "http")]
            in_flight: self.in_flight.clone(),
        }
    }
}

impl<DB: Backend> fmt::Debug for Inbox<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inbox")
            .field("table", &self.config.table)
            .field("settings", &self.config.settings)
            .field("retention", &self.config.retention)
            .field("for_worker", &self.worker.is_some())
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
impl Inbox<sqlx::Sqlite> {
    /// An inbox in a private in-memory SQLite database, migrated, for the unit tests of your own
    /// handlers (those taking `&mut sqlx::SqliteConnection`): create your tables on
    /// [`pool()`](Inbox::pool) and call the handlers with it. The database has one
    /// connection, so concurrent calls take turns (one that waits more than 5 seconds for it fails
    /// with a retryable pool timeout), and it is gone when the last clone is dropped. A worker's
    /// inbox ([`for_worker`](Inbox::for_worker)) keeps that connection between its
    /// messages, and the inbox's own reads use it too, but your queries on the pool wait until the
    /// worker's inbox is dropped.
    /// It behaves like the file-based inbox (the conformance suite runs on it), but it proves
    /// nothing about your production database.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let inbox = idempotent_runtime::Inbox::<sqlx::Sqlite>::in_memory().await?;
    /// sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY)").execute(inbox.pool()).await?;
    /// # Ok(()) }
    /// ```
    pub async fn in_memory() -> Result<Self, InboxError> {
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            // The pool's check of a connection as it is taken is a step that, cancelled (a
            // timeout around a handler), closes the connection: that would be the database.
            .test_before_acquire(false)
            .acquire_timeout(std::time::Duration::from_secs(5))
            .connect("sqlite::memory:")
            .await
            .map_err(database_error(Stage::Migrate))?;
        let inbox = Self::new(pool);
        inbox.migrate().await?;
        Ok(inbox)
    }
}

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
impl Inbox<sqlx::Postgres> {
    /// The same inbox, sending the claim in one message with its `BEGIN`: one round trip less per
    /// message, at the price the [`postgres` module docs](crate::postgres) describe (a committed duplicate is reported by
    /// the server as a unique violation, which it logs at `ERROR` with the statement, and leaves a
    /// dead row version). Both claims wait for a concurrent claim of the same key in the same way.
    /// (Only PostgreSQL has it: its protocol lets the claim ride in the `BEGIN`'s message while
    /// the inbox still learns the outcome, from the statement's error.)
    pub fn with_pipelined_claim(self) -> Self {
        self.with_settings(|_| crate::store::postgres::pipelined())
    }

    /// The same inbox, for a pool whose connections go through a pooler in transaction mode
    /// (PgBouncer's `pool_mode = transaction`), which hands each transaction whichever server
    /// session is free. The inbox then prepares none of its statements, runs those it sends
    /// outside a handler's transaction (a duplicate's stored response, [`is_processed`](Self::is_processed),
    /// the steps of a call, each purge batch) in a transaction of their own, holds the purger's
    /// lock with a transaction left open for the purge's length instead of a session's lock, and
    /// claims with the quiet claim whatever [`with_pipelined_claim`](Self::with_pipelined_claim)
    /// said. Without it, [`migrate`](Self::migrate) refuses such a pool with
    /// [`InboxError::TransactionPooling`].
    ///
    /// The handlers' own statements need the same care: see the crate's README ("Running at
    /// scale") for the pool's and PgBouncer's settings that make sqlx work through such a pooler.
    pub fn with_transaction_pooling(self) -> Self {
        self.with_config(|config| Config {
            statements: config.statements.clone().with_pooling(true),
            ..config.clone()
        })
    }
}

/// Checks a consumer name before it reaches any SQL.
pub(crate) fn check_consumer(consumer: &str) -> Result<(), InboxError> {
    check_name(consumer).map_err(|reason| InboxError::ConsumerName {
        name: consumer.to_owned(),
        reason,
    })
}

/// What is wrong with a consumer or call name, if anything: empty, longer than
/// [`MAX_CONSUMER_LEN`] bytes, or holding a NUL byte (which PostgreSQL's text cannot hold).
pub(crate) fn check_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        Err("it is empty")
    } else if name.len() > MAX_CONSUMER_LEN {
        Err("it is longer than 200 bytes")
    } else if name.contains('\0') {
        Err("it holds a NUL byte")
    } else {
        Ok(())
    }
}

/// A transaction in which this caller holds the claim on a message key. Run the handler's work on
/// [`connection`](Self::connection), then [`commit`](Self::commit) to record the effect and the key
/// together. Dropping it (a panic, a cancelled future) rolls back, so the key stays unclaimed.
pub struct Claimed<DB: Backend> {
    tx: InboxTransaction<DB>,
    consumer: Box<str>,
    key: MessageKey,
    config: Arc<Config<DB>>,
    metrics: Arc<Metrics>,
    /// The messages to write to the outbox at the commit.
    outbox: Outbox,
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
            outbox: Outbox::of(consumer, key.clone()),
            consumer: consumer.into(),
            key,
            config: inbox.config.clone(),
            metrics: inbox.metrics.clone(),
        }
    }

    /// Stores `response` (bytes as they are) with the claimed row, in this transaction.
    pub(crate) async fn store_response(&mut self, response: &[u8]) -> Result<(), InboxError> {
        DB::set_response(
            self.tx.connection(),
            &self.config.statements.inbox,
            &self.consumer,
            self.key.as_bytes(),
            response,
        )
        .await
        .map_err(database_error(Stage::StoreResponse))
    }

    /// The transaction's connection, for the handler's own statements.
    pub fn connection(&mut self) -> &mut DB::Connection {
        self.tx.connection()
    }

    /// The messages to send with this transaction: [`commit`](Self::commit) writes them to the
    /// [outbox](crate::outbox) table before it commits, so that they commit with the handler's
    /// work. Their ids derive from the consumer, the key and their position.
    pub fn outbox(&mut self) -> &mut Outbox {
        &mut self.outbox
    }

    /// The transaction's connection and the outbox, both at once (what a handler with an
    /// `outbox: &mut Outbox` parameter is handed).
    pub fn connection_and_outbox(&mut self) -> (&mut DB::Connection, &mut Outbox) {
        (self.tx.connection(), &mut self.outbox)
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

    /// Commits the handler's work and the claim together, if the transaction is still the one the
    /// claim began and nothing in it failed: otherwise rolls back and returns
    /// [`InboxError::TransactionAborted`] or [`InboxError::TransactionEnded`], never `Ok`.
    pub async fn commit(self) -> Result<(), InboxError> {
        let Self {
            mut tx,
            consumer,
            key,
            config,
            metrics,
            outbox,
        } = self;
        let claim = (&config.statements, &*consumer, &key);
        let written =
            outgoing::write::<DB>(tx.connection(), &config.statements.outbox, &outbox).await;
        let committed = match written {
            Ok(()) => commit(tx, Some(claim)).await,
            Err(error) => {
                // Nothing of the message is committed: its redelivery queues the messages again.
                let _ = tx.rollback().await;
                Err(error)
            }
        };
        match &committed {
            Ok(()) => {
                metrics.message(&consumer, Outcome::Processed, 1);
                tracing::Span::current().record("outcome", "processed");
                tracing::debug!(%consumer, key = %key.digest(), "committed");
            }
            Err(error) => {
                metrics.message(&consumer, Outcome::RolledBack, 1);
                tracing::Span::current().record("outcome", "commit failed");
                tracing::warn!(%consumer, key = %key.digest(), %error, "commit failed");
            }
        }
        committed
    }

    /// Rolls back the handler's work and the claim: a redelivery will run the handler again.
    pub async fn rollback(self) {
        self.metrics.message(&self.consumer, Outcome::RolledBack, 1);
        tracing::Span::current().record("outcome", "rolled back");
        tracing::debug!(consumer = %self.consumer, key = %self.key.digest(), "rolled back");
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
        self.metrics.message(&self.consumer, Outcome::RolledBack, 1);
        tracing::Span::current().record("outcome", "rolled back");
        tracing::debug!(consumer = %self.consumer, key = %self.key.digest(), ?fault, "handler failed; rolled back");
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
        let (session, later_writes_refused) = match self.tx.rollback_checked().await {
            Ok((RolledBack::Own, _)) => return Err(Error::Handler(error)),
            Err(_) => return Err(Error::Transient(error)),
            Ok((
                RolledBack::Replaced {
                    later_writes_refused,
                },
                session,
            )) => (session, later_writes_refused),
        };
        // The body ended the inbox's transaction itself before it failed.
        let claim = (&self.config.statements, &*self.consumer, &self.key);
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

/// Commits `tx`, or says why it did not: the error of every way a commit can end but committed.
/// `claim` is the claim to look for when the body ended the transaction itself; without it, such a
/// transaction counts as having committed its claims.
pub(crate) async fn commit<DB: Backend>(
    tx: InboxTransaction<DB>,
    claim: Option<(&Statements, &str, &MessageKey)>,
) -> Result<(), InboxError> {
    Err(match tx.commit().await {
        Ok((Ending::Committed, _)) => return Ok(()),
        Ok((Ending::Aborted, _)) => InboxError::TransactionAborted,
        Ok((
            Ending::Replaced {
                later_writes_refused,
            },
            session,
        )) => ended_by_body(session, claim, later_writes_refused).await,
        Ok((Ending::Refused(error), _)) | Err(error) => database_error(Stage::Commit)(error),
    })
}

/// The error for a transaction the body ended (its own `COMMIT` or `ROLLBACK`, a statement that
/// commits implicitly) before the inbox could end it, read on `session`: whether it took `claim`
/// with it. Without a claim to look for, the transaction counts as having committed its claims.
async fn ended_by_body<DB: Backend>(
    mut session: Session<DB>,
    claim: Option<(&Statements, &str, &MessageKey)>,
    later_writes_refused: bool,
) -> InboxError {
    let key_committed = match claim {
        Some((statements, consumer, key)) => {
            let row = session
                .step(|conn| DB::stored(conn, &statements.inbox, consumer, key.as_bytes()))
                .await;
            // Unknown counts as committed: a redelivery is then at worst a duplicate.
            row.map_or(true, |row| row.is_some())
        }
        None => true,
    };
    InboxError::TransactionEnded {
        key_committed,
        later_writes_refused,
    }
}

/// Decodes a stored response.
pub(crate) fn decode_response<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, InboxError> {
    serde_json::from_slice(bytes).map_err(|error| InboxError::Response {
        source: error.into(),
    })
}
