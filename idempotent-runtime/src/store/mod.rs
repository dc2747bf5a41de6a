//! What differs per database, behind one sealed trait, and the statements that are the same on
//! every database, written once.
//!
//! Every backend keeps one inbox table whose primary key is `(consumer, message_key)`, with the key
//! stored as bytes, the time it was processed, and room for a stored response and a payload
//! fingerprint; a `<table>_calls` table for calls to outside services; `<table>_horizons`, each
//! consumer's purge horizon; `<table>_audit`, the messages forgotten on purpose; and
//! `<table>_schema`, the versions of these tables (see [`schema`](crate::schema)). A backend says how its
//! SQL is spelt ([`Dialect`](statements::Dialect)), how the handler's transaction begins and how
//! the inbox makes sure, at its end, that it is still the one it began (`Store`), the DDL, the
//! batch claim and the purger's lock. The statements themselves are built from the dialect in one
//! place (`statements.rs`) and run by one generic implementation for every backend
//! (`queries.rs`). What happens to a transaction and its connection is not the backends' business:
//! they report what happened, and [`transaction`](crate::transaction) decides.

use std::future::Future;

use sqlx::Pool;
use sqlx::pool::PoolConnection;

use crate::error::{Fault, InboxError, Stage};
use crate::table::TableName;

#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub mod mysql;
#[cfg(feature = "http")]
pub(crate) mod no_wait;
mod outbox;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
mod queries;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub mod sqlite;
mod statements;

pub(crate) use outbox::{
    Failure, NewRow, OutboxDialect, OutboxQueries, OutboxStatements, PARKED, PENDING, SENT,
    ShownRow,
};
pub(crate) use queries::{
    Queries, QueryBuilder, begin_own_transaction, end_own_transaction, in_own_transaction,
};
pub(crate) use statements::{
    CallId, CallRow, Dialect, PurgeScope, PurgeSql, PurgeStatements, Statements,
};

/// A database the inbox can live in: [`sqlx::Postgres`], [`sqlx::Sqlite`] and [`sqlx::MySql`]
/// (with the `postgres`, `sqlite` and `mysql` features). Sealed: what it requires is the inbox's
/// business, not a user's.
pub trait Backend: private::Store + Queries + OutboxQueries {}

/// A connection type a handler can take: `&mut sqlx::PgConnection`, `&mut sqlx::SqliteConnection`
/// or `&mut sqlx::MySqlConnection`. It names the [`Backend`] whose [`Inbox`](crate::Inbox) the
/// rewritten handler takes instead.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a connection an inbox can live on",
    label = "the first parameter of an `#[idempotent]` handler is the transaction's connection",
    note = "write `&mut sqlx::PgConnection`, `&mut sqlx::SqliteConnection` or `&mut sqlx::MySqlConnection`, and enable the crate's feature of the same database"
)]
pub trait HandlerConnection {
    /// The database this connection talks to.
    type Backend: Backend;
}

pub(crate) use private::{Ending, RolledBack, Store};

mod private {
    use super::*;

    /// How the inbox found its transaction at the commit.
    #[derive(Debug)]
    pub enum Ending {
        /// It was open, it was the one the inbox began, and it committed.
        Committed,
        /// A statement failed in it and the body carried on: the server aborted it. Nothing was
        /// committed; the transaction is rolled back.
        Aborted,
        /// It was no longer the one the inbox began (the body, or the database, ended it); whatever
        /// was open instead is rolled back.
        Replaced {
            /// Writes the body made after the end could not commit on their own.
            later_writes_refused: bool,
        },
        /// The database refused the commit (a Galera certification conflict, a full disk):
        /// nothing was committed, and the connection is fine.
        Refused(sqlx::Error),
    }

    /// Whose transaction [`Store::rollback_checked`] rolled back.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum RolledBack {
        /// The one the inbox began.
        Own,
        /// Another, or none: the body (or the database) had ended the inbox's transaction.
        Replaced {
            /// Writes the body made after the end could not commit on their own.
            later_writes_refused: bool,
        },
    }

    /// Everything a backend answers for. Not nameable outside the crate.
    pub trait Store: sqlx::Database + Sized {
        /// How this database spells the shared statements.
        const DIALECT: Dialect;

        /// The database lets one transaction write at a time (SQLite): an inbox then queues its
        /// own writers in the process rather than have them poll the database's lock.
        const ONE_WRITER: bool = false;

        /// The driver recovers a connection whose future was dropped in the middle of a step
        /// (SQLite: the step completes in the connection's worker thread, and a `BEGIN` nobody
        /// saw is rolled back there); elsewhere such a connection is closed.
        const CANCEL_SAFE: bool = false;

        /// Writes a body makes after its transaction ended under it (its own `COMMIT` or
        /// `ROLLBACK`) cannot commit on their own: SQLite's commit hook refuses them, MySQL's
        /// autocommit stays off (unless the body turns it on: [`Ending::Replaced`] says what was
        /// found). On PostgreSQL they commit on their own.
        const REFUSES_LATER_WRITES: bool = false;

        /// Begins the handler's transaction, together with whatever lets [`commit`](Store::commit)
        /// tell later that the transaction is still the one the inbox began.
        const BEGIN: &'static str;

        /// Begins a relay's batch: [`BEGIN`](Store::BEGIN), at an isolation level whose locking
        /// reads lock the rows they take and nothing between them, so that a batch holding its
        /// rows while the broker confirms them never makes a writer's insert wait (InnoDB's
        /// `REPEATABLE READ` locks the gaps a scan passed, the table's end included).
        const BEGIN_RELAY: &'static str = Self::BEGIN;

        /// This backend's settings of an inbox (PostgreSQL: which claim it sends).
        type Settings: Default + Clone + Send + Sync + std::fmt::Debug + 'static;

        /// What the inbox keeps while its transaction is open (SQLite: the state its commit
        /// hook reads); dropped when the transaction ends.
        type TransactionState: Send + Sync + 'static;

        /// Readies `conn` for a transaction of the inbox, before its `BEGIN`.
        fn ready_transaction(
            conn: &mut Self::Connection,
        ) -> impl Future<Output = Result<Self::TransactionState, sqlx::Error>> + Send;

        /// The message that begins the transaction and claims the key in one round trip, if this
        /// backend and its settings send one: a committed duplicate then fails it with a unique
        /// violation.
        fn pipelined_claim(
            _settings: &Self::Settings,
            _statements: &Statements,
            _consumer: &str,
            _key: &[u8],
            _fingerprint: Option<&[u8]>,
        ) -> Option<String> {
            None
        }

        /// Prepares, on `conn`'s session, the statement [`pipelined_claim`](Store::pipelined_claim)
        /// executes.
        fn prepare_pipelined_claim(
            _conn: &mut Self::Connection,
            _settings: &Self::Settings,
            _statements: &Statements,
        ) -> impl Future<Output = Result<(), sqlx::Error>> + Send {
            async { Ok(()) }
        }

        /// Commits the open transaction if it is still the one the inbox began and nothing in it
        /// failed; otherwise rolls back what is open, and says which. An `Err` leaves the outcome
        /// unknown.
        fn commit(
            conn: &mut Self::Connection,
            state: &Self::TransactionState,
        ) -> impl Future<Output = Result<Ending, sqlx::Error>> + Send;

        /// Rolls back the open transaction (and undoes what [`BEGIN`](Store::BEGIN) changed in
        /// the session).
        fn rollback(
            conn: &mut Self::Connection,
            state: &Self::TransactionState,
        ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

        /// Rolls back as [`rollback`](Store::rollback) does, after a body that failed, and says
        /// whether what it rolled back was still the transaction the inbox began (the check
        /// [`commit`](Store::commit) makes; one more round trip on PostgreSQL, none elsewhere).
        fn rollback_checked(
            conn: &mut Self::Connection,
            state: &Self::TransactionState,
        ) -> impl Future<Output = Result<RolledBack, sqlx::Error>> + Send;

        /// What this backend's database error says about retrying; `None` when `error` is not
        /// this backend's.
        fn fault(error: &dyn sqlx::error::DatabaseError) -> Option<Fault>;

        /// Whether `error` says the session lost a prepared statement (PostgreSQL: SQLSTATE 26000
        /// after a `DEALLOCATE`), which clearing the driver's statement cache repairs.
        fn lost_statement(_error: &sqlx::Error) -> bool {
            false
        }

        /// Whether `error` says the session has a prepared statement of that name already
        /// (PostgreSQL: SQLSTATE 42P05).
        fn statement_exists(_error: &sqlx::Error) -> bool {
            false
        }

        /// The tables of schema version 1 (the first release), each statement creating one thing
        /// if it is missing; [`upgrade_ddl`](Store::upgrade_ddl) brings them to later versions.
        fn base_ddl(table: &TableName) -> Vec<String>;

        /// The statements that upgrade the tables from version `to - 1` to `to` (not the record
        /// of the version, which [`schema`](crate::schema) adds).
        fn upgrade_ddl(table: &TableName, to: u32) -> Vec<String>;

        /// Whether a step of an upgrade failed only because it was applied before (MySQL, whose
        /// DDL is not transactional, so that an upgrade cut off half-way is run again).
        fn applied_before(_error: &sqlx::Error) -> bool {
            false
        }

        /// Takes the migration's lock on `conn`: a transaction that serializes concurrent
        /// migrations (PostgreSQL, SQLite), or a session lock (MySQL, whose DDL commits
        /// implicitly).
        fn lock_migration<'a>(
            conn: &'a mut Self::Connection,
            table: &'a TableName,
        ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

        /// Ends what [`lock_migration`](Store::lock_migration) began: commits (or, when `commit`
        /// is false, rolls back) and releases the lock.
        fn unlock_migration<'a>(
            conn: &'a mut Self::Connection,
            table: &'a TableName,
            commit: bool,
        ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

        /// Whether the table `name` (unquoted) exists where the connection creates tables
        /// (PostgreSQL: `current_schema()`; MySQL: `DATABASE()`; SQLite: `main`), never in
        /// another schema or database the connection could also read; see [`schema`](crate::schema).
        fn table_exists<'a>(
            conn: &'a mut Self::Connection,
            name: &'a str,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

        /// Claims every key of `keys` (sorted, without repeats) for `consumer` in the open
        /// transaction, in key order so that two batches with overlapping keys wait for each other
        /// instead of deadlocking; returns the keys this call inserted.
        fn claim_batch<'a>(
            conn: &'a mut Self::Connection,
            statements: &'a Statements,
            consumer: &'a str,
            keys: &'a [&'a [u8]],
        ) -> impl Future<Output = Result<Vec<Vec<u8>>, sqlx::Error>> + Send + 'a;

        /// Takes the purger's lock for `table` on `conn` if no other session holds it. `pooled`:
        /// a pooler in transaction mode sits in front of the database (see
        /// [`Statements::pooled`]), so a lock must not outlive a transaction.
        fn try_lock_purge<'a>(
            conn: &'a mut Self::Connection,
            table: &'a TableName,
            pooled: bool,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

        /// Releases the purger's lock taken on `conn`.
        fn unlock_purge<'a>(
            conn: &'a mut Self::Connection,
            table: &'a TableName,
            pooled: bool,
        ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

        /// Whether a pooler in transaction mode sits between `pool` and the database, which the
        /// inbox's statements must then be sent for (see [`Statements::pooled`]); the inbox
        /// refuses to [migrate](crate::Inbox::migrate) when it finds one it was not told about.
        fn transaction_pooled(
            _pool: &Pool<Self>,
        ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + '_ {
            async { Ok(false) }
        }

        /// The purger's lock lives in the session (PostgreSQL, MySQL), rather than nowhere
        /// (SQLite serializes its writers anyway).
        const PURGE_LOCK: bool = true;

        /// Starts a task that calls `wake` each time a transaction that wrote outbox rows commits
        /// (PostgreSQL: `LISTEN` on `channel`, which [`OutboxDialect::notify`] notifies), and
        /// once after each reconnection (notifications sent meanwhile are lost); `None` where the
        /// database has no such thing, and relays only poll.
        fn listen_outbox(
            _pool: &Pool<Self>,
            _channel: &str,
            _wake: std::sync::Arc<dyn Fn() + Send + Sync>,
        ) -> Option<tokio::task::JoinHandle<()>> {
            None
        }
    }
}

/// Whether a driver error is transient, so that the same work may succeed when tried again:
/// serialization failures, deadlocks, lock timeouts, a busy or locked SQLite database, a Galera
/// node that left its cluster, lost or refused connections, an exhausted pool. For your own
/// handlers' errors; an `#[idempotent]` handler's outcome already says it
/// ([`Error::is_retryable`](crate::Error::is_retryable)).
pub fn is_retryable(error: &sqlx::Error) -> bool {
    fault_of(error) != Fault::None
}

/// The inbox's error for a driver error at `stage`, classified by the backend it came from.
pub(crate) fn database_error(stage: Stage) -> impl FnOnce(sqlx::Error) -> InboxError {
    move |source| InboxError::Database {
        stage,
        fault: fault_of(&source),
        source,
    }
}

/// What a driver error, or one in its sources, says about retrying, whichever enabled backend it
/// came from.
pub(crate) fn fault_of(error: &(dyn std::error::Error + 'static)) -> Fault {
    use sqlx::error::DatabaseError;
    let mut next = Some(error);
    while let Some(error) = next {
        // The handler's own mark of a transient failure (a downstream 503).
        if error.is::<crate::Retryable>() {
            return Fault::Transient;
        }
        if let Some(error) = error.downcast_ref::<sqlx::Error>() {
            return match error {
                sqlx::Error::Io(_)
                | sqlx::Error::Protocol(_)
                | sqlx::Error::Tls(_)
                | sqlx::Error::WorkerCrashed => Fault::Broken,
                sqlx::Error::PoolTimedOut => Fault::Transient,
                sqlx::Error::Database(database) => fault_of_database(database.as_ref()),
                _ => Fault::None,
            };
        }
        // What sqlx's error gives as its source, which a transparent wrapper passes on.
        if let Some(database) = error.downcast_ref::<Box<dyn DatabaseError>>() {
            return fault_of_database(database.as_ref());
        }
        next = error.source();
    }
    Fault::None
}

/// What a database's error says about retrying, asking each enabled backend.
fn fault_of_database(error: &dyn sqlx::error::DatabaseError) -> Fault {
    #[cfg(feature = "postgres")]
    if let Some(fault) = <sqlx::Postgres as Store>::fault(error) {
        return fault;
    }
    #[cfg(feature = "sqlite")]
    if let Some(fault) = <sqlx::Sqlite as Store>::fault(error) {
        return fault;
    }
    #[cfg(feature = "mysql")]
    if let Some(fault) = <sqlx::MySql as Store>::fault(error) {
        return fault;
    }
    let _ = error;
    Fault::None
}

/// A connection holding the purger's lock (a session's lock; behind a pooler in transaction mode,
/// the lock of a transaction left open on it): released by [`PurgeLock::unlock`], or, when dropped
/// without it (a cancelled purge, a purge that failed), closed, which releases the lock with the
/// session or the transaction.
pub(crate) struct PurgeLock<DB: Backend> {
    connection: Option<PoolConnection<DB>>,
    pooled: bool,
}

impl<DB: Backend> PurgeLock<DB> {
    /// Takes the purger's lock for `table` if no other instance holds it.
    pub(crate) async fn try_lock(
        pool: &Pool<DB>,
        table: &TableName,
        pooled: bool,
    ) -> Result<Option<Self>, sqlx::Error> {
        if !DB::PURGE_LOCK {
            return Ok(Some(Self {
                connection: None,
                pooled,
            }));
        }
        // Held by the lock from here on, so that a purge dropped while the lock statement runs
        // closes the session rather than let it go back to the pool with the lock taken.
        let mut lock = Self {
            connection: Some(pool.acquire().await?),
            pooled,
        };
        let connection = lock.connection.as_mut().expect("just set");
        if DB::try_lock_purge(connection, table, pooled).await? {
            return Ok(Some(lock));
        }
        // Not taken: nothing is held, and the connection goes back to the pool.
        lock.connection.take();
        Ok(None)
    }

    /// Releases the lock; when that fails, the session is closed, which releases it too.
    pub(crate) async fn unlock(mut self, table: &TableName) -> Result<(), sqlx::Error> {
        let Some(connection) = self.connection.as_mut() else {
            return Ok(());
        };
        DB::unlock_purge(connection, table, self.pooled).await?;
        self.connection.take();
        Ok(())
    }
}

impl<DB: Backend> Drop for PurgeLock<DB> {
    fn drop(&mut self) {
        if let Some(connection) = &mut self.connection {
            connection.close_on_drop();
        }
    }
}
