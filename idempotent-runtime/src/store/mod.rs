//! The tables and what differs per database.
//!
//! Every backend keeps one inbox table whose primary key is `(consumer, message_key)`, with the key
//! stored as bytes, the time it was processed, and room for a stored response and a payload
//! fingerprint; a `<table>_calls` table for calls to outside services; `<table>_horizons`, each
//! consumer's purge horizon; `<table>_audit`, the messages forgotten on purpose; and
//! `<table>_schema`, the versions of these tables (see [`schema`](crate::schema)).
//!
//! One module per table holds its statements, built from the database's [`Dialect`] (`dialect.rs`),
//! next to the one generic implementation that runs them on every backend: `inbox.rs`, `calls.rs`,
//! `purge.rs` (the horizons, the purge's passes and its lock), `audit.rs` (and the schema's
//! version), `stats.rs` and `outbox.rs`; `statements.rs` gathers them, `query.rs` holds what they
//! share (nothing prepared behind a pooler, a transaction of its own there). What differs per
//! database is one sealed trait (`driver.rs`), implemented by `postgres`, `sqlite` and `mysql`.
//! Nothing here imports from above the store.

use crate::error::{Fault, InboxError, Stage};

mod audit;
mod calls;
mod dialect;
mod driver;
mod inbox;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub mod mysql;
mod outbox;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
mod purge;
mod query;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub mod sqlite;
mod statements;
mod stats;
#[cfg(feature = "http")]
pub(crate) mod try_claim;

pub(crate) use audit::{AuditQueries, AuditRow};
pub(crate) use calls::{CallGate, CallId, CallQueries, CallRow, StuckRow};
// The backends' modules build their dialects with these: none without a backend.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "sqlite")),
    allow(unused_imports)
)]
pub(crate) use dialect::{Dialect, Heads, OutboxDialect};
pub(crate) use driver::{Ending, RolledBack, Store};
pub(crate) use inbox::{InboxQueries, InboxStatements, InspectRow, ListRow, StoredRow};
pub(crate) use outbox::{
    Failure, HeldRow, KeyShare, NewRow, OutboxQueries, OutboxStatements, PARKED, PENDING,
    ParkedRows, SENT, SKIPPED, ShownRow, TakenRow,
};
pub(crate) use purge::{PurgeLock, PurgeQueries, PurgeScope, PurgeSql, PurgeStatements};
pub(crate) use query::{
    ConnectionQueries, QueryBuilder, begin_own_transaction, end_own_transaction, in_own_transaction,
};
pub(crate) use statements::Statements;
pub(crate) use stats::StatsQueries;

/// A database the inbox can live in: [`sqlx::Postgres`], [`sqlx::Sqlite`] and [`sqlx::MySql`]
/// (with the `postgres`, `sqlite` and `mysql` features). Sealed: what it requires is the inbox's
/// business, not a user's.
pub trait Backend:
    Store
    + ConnectionQueries
    + InboxQueries
    + CallQueries
    + PurgeQueries
    + AuditQueries
    + StatsQueries
    + OutboxQueries
{
}

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

/// Returns whether a driver error is transient, so that the same work may succeed when tried again:
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
