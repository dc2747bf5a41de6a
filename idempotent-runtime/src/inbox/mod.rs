//! The inbox: a pool, a table, and the claim that begins each handler's transaction.
//!
//! `mod.rs` holds the [`Inbox`] itself (where its connections come from, its migration, its
//! reads); `config.rs` what it is configured with; `claim.rs` the claims; `claimed.rs` the claimed
//! transaction ([`Claimed`]) and `commit.rs` how it ends; `handled.rs` a handler's outcome;
//! `outgoing.rs` the messages a claimed transaction queues for the outbox; `purge.rs` the purge of
//! expired rows.

use std::fmt;
use std::sync::Arc;

use sqlx::Pool;
use tokio::sync::Semaphore;

use crate::error::{InboxError, Stage};
use crate::key::AsMessageKey;
use crate::metrics::{Metrics, MetricsSnapshot};
use crate::retention::Retention;
use crate::schema::{self, Migration};
use crate::session::{Session, Source, Spares, Worker};
use crate::store::{Backend, HandlerConnection, Statements, database_error};
use crate::table::TableName;
use crate::transaction::Resources;

mod claim;
mod claimed;
mod commit;
mod config;
mod handled;
pub(crate) mod outgoing;
mod purge;
#[cfg(feature = "http")]
mod try_claim;
mod wakeups;

pub use claim::{Claim, ClaimOptions};
pub use claimed::Claimed;
pub(crate) use commit::{commit, decode_response};
pub(crate) use config::Config;
#[cfg(feature = "testing")]
pub(crate) use config::Injected;
pub use handled::Handled;
#[cfg(feature = "http")]
pub(crate) use try_claim::{KeyCommitted, TryClaimed};

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
    /// What wakes the relays after commits that wrote outgoing messages.
    pub(crate) wakeups: Arc<wakeups::Wakeups>,
}

/// The inbox a handler taking a `&mut C` connection is rewritten to take:
/// `InboxFor<sqlx::PgConnection>` is `Inbox<sqlx::Postgres>`.
pub type InboxFor<C> = Inbox<<C as HandlerConnection>::Backend>;

impl<DB: Backend> Inbox<DB> {
    /// Creates an inbox in the table `idempotent_inbox` of `pool`'s database, keeping rows for the
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
                tenant: None,
                #[cfg(feature = "testing")]
                injected: None,
            }),
            pool,
            metrics: Arc::default(),
            spares: Arc::default(),
            worker: None,
            writers: DB::ONE_WRITER.then(|| Arc::new(Semaphore::new(1))),
            #[cfg(feature = "http")]
            in_flight: Arc::default(),
            wakeups: Arc::default(),
        }
    }

    /// Returns the same inbox for one worker that handles messages one after another: it keeps the
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
    /// # use idempotent_runtime as idempotent;
    /// # async fn demo(inbox: idempotent::Inbox<sqlx::Postgres>) {
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

    /// Returns the pool the inbox runs on.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }

    /// Returns the inbox table's name.
    pub fn table(&self) -> &TableName {
        &self.config.table
    }

    /// Returns what this inbox (and its clones) counted so far.
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
            begin_suffix: &self.config.statements.begin_suffix,
        }
    }

    /// Returns whether the inbox records `key` as processed by `consumer` (committed claims only).
    /// `key` is a [`MessageKey`](crate::MessageKey) or any [`StableKey`](crate::StableKey) value.
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
            wakeups: self.wakeups.clone(),
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
    /// Creates an inbox in a private in-memory SQLite database, migrated, for the unit tests of
    /// your own handlers (those taking `&mut sqlx::SqliteConnection`): create your tables on
    /// [`pool()`](Inbox::pool) and call the handlers with it. The database has one connection, so
    /// concurrent calls take turns (one that waits more than 5 seconds for it fails with a
    /// retryable pool timeout), and it is gone when the last clone is dropped. A worker's inbox
    /// ([`for_worker`](Inbox::for_worker)) keeps that connection between its messages, and the
    /// inbox's own reads use it too, but your queries on the pool wait until the worker's inbox is
    /// dropped. It behaves like the file-based inbox (the conformance suite runs on it), but it
    /// proves nothing about your production database.
    ///
    /// ```
    /// # use idempotent_runtime as idempotent;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let inbox = idempotent::Inbox::<sqlx::Sqlite>::in_memory().await?;
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
