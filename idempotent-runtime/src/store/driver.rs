//! What differs per database, behind one sealed trait: how the handler's transaction begins and
//! how the inbox makes sure, at its end, that it is still the one it began; the DDL; the batch
//! claim; the purger's lock; what an error says about retrying. What happens to a transaction and
//! its connection is not the backends' business: they report what happened, and
//! [`transaction`](crate::transaction) decides.

use std::future::Future;

use sqlx::Pool;

use super::dialect::Dialect;
use super::inbox::InboxStatements;
use crate::error::Fault;
use crate::table::TableName;

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
    /// An aborted one (a statement failed in it), which cannot say whose it was (PostgreSQL): the
    /// inbox's, or one the body began after it ended the inbox's.
    Aborted,
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

    /// The message that begins the transaction (with `begin`, the statements that begin it) and
    /// claims the key in one round trip, if this backend and its settings send one: a committed
    /// duplicate then fails it with a unique violation.
    fn pipelined_claim(
        _settings: &Self::Settings,
        _statements: &InboxStatements,
        _begin: &str,
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
        _statements: &InboxStatements,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send {
        async { Ok(()) }
    }

    /// Whether `conn`'s session lost statements the driver prepared and still has in its cache (a
    /// body's `DEALLOCATE ALL`, or a `DEALLOCATE` of one of them); then the cache must be
    /// forgotten. A session that only never prepared this inbox's pipelined claim (a new
    /// connection, another tenant's first claim on it) lost nothing.
    fn lost_driver_statements(
        _conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send {
        async { Ok(true) }
    }

    /// Commits the open transaction if it is still the one the inbox began and nothing in it
    /// failed; otherwise rolls back what is open, and says which. An `Err` leaves the outcome
    /// unknown.
    fn commit(
        conn: &mut Self::Connection,
        state: &Self::TransactionState,
    ) -> impl Future<Output = Result<Ending, sqlx::Error>> + Send;

    /// Commits the open transaction, which a statement of the inbox's proved to be the one it
    /// began with nothing failed in it ([`Dialect::own_transaction`](super::Dialect)), with no
    /// statement of the body's since. Where nothing proves it, [`commit`](Store::commit).
    fn commit_proven(
        conn: &mut Self::Connection,
        state: &Self::TransactionState,
    ) -> impl Future<Output = Result<Ending, sqlx::Error>> + Send {
        Self::commit(conn, state)
    }

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

    /// Whether the table `name` (unquoted) exists in `schema` (PostgreSQL, an inbox made for a
    /// schema) or else where the connection creates tables (PostgreSQL: `current_schema()`;
    /// MySQL: `DATABASE()`; SQLite: `main`), never in another schema or database the connection
    /// could also read; see [`schema`](crate::schema).
    fn table_exists<'a>(
        conn: &'a mut Self::Connection,
        schema: Option<&'a str>,
        name: &'a str,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Claims every key of `keys` (sorted, without repeats) for `consumer` in the open
    /// transaction, in key order so that two batches with overlapping keys wait for each other
    /// instead of deadlocking; returns the keys this call inserted.
    fn claim_batch<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a InboxStatements,
        consumer: &'a str,
        keys: &'a [&'a [u8]],
    ) -> impl Future<Output = Result<Vec<Vec<u8>>, sqlx::Error>> + Send + 'a;

    /// Takes the purger's lock for `table` on `conn` if no other session holds it. `pooled`:
    /// a pooler in transaction mode sits in front of the database (see
    /// [`Statements::pooled`](super::Statements::pooled)), so a lock must not outlive a transaction.
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
    /// inbox's statements must then be sent for (see [`Statements::pooled`](super::Statements::pooled)); the inbox
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
    /// (PostgreSQL: `LISTEN` on `channel`, which `OutboxDialect::notify` notifies), and
    /// once after each reconnection (notifications sent meanwhile are lost); `None` where the
    /// database has no such thing, and relays only poll.
    fn listen_outbox(
        _pool: &Pool<Self>,
        _channel: &str,
        _wake: std::sync::Arc<dyn Fn() + Send + Sync>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        None
    }

    /// Where a [`listen_outbox`](Store::listen_outbox) on `pool` hears from (PostgreSQL: the
    /// server, database and user its connections go to): a relay over several inboxes listens
    /// once for each place and channel.
    fn listen_scope(_pool: &Pool<Self>) -> String {
        String::new()
    }
}
