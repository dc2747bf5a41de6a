//! The store trait and one module per database.
//!
//! Every backend keeps one inbox table whose primary key is `(consumer, message_key)`, with the key
//! stored as bytes and the time it was processed. What differs is how a transaction begins and how
//! the claim handles a conflict; each module's docs say how, and why that blocks a concurrent
//! duplicate until the first claim commits or rolls back.

use std::future::Future;
use std::sync::Arc;

use sqlx::{Pool, Transaction};

use crate::table::TableName;

#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub mod mysql;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub mod sqlite;

mod sealed {
    pub trait Sealed {}
}
pub(crate) use sealed::Sealed;

/// A database the inbox can live in: implemented for [`sqlx::Postgres`], [`sqlx::Sqlite`] and
/// [`sqlx::MySql`] (with the `postgres`, `sqlite` and `mysql` features). Sealed: its methods are the inbox's internals.
pub trait Backend: sqlx::Database + Sealed {
    #[doc(hidden)]
    /// Builds the SQL of the per-message statements once per inbox.
    fn statements(table: &TableName) -> Statements;

    #[doc(hidden)]
    /// Takes a connection and begins a transaction that will write.
    fn begin(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send;

    #[doc(hidden)]
    /// Inserts `(consumer, key)` unless it is there; `true` when this call inserted it. A concurrent
    /// uncommitted insert of the same row makes this wait for that transaction to end.
    fn claim<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        consumer: &'a str,
        key: &'a [u8],
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    #[doc(hidden)]
    /// Whether `(consumer, key)` is in the inbox, as seen outside any handler's transaction.
    fn contains<'a>(
        pool: &'a Pool<Self>,
        statements: &'a Statements,
        consumer: &'a str,
        key: &'a [u8],
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    #[doc(hidden)]
    /// Creates the inbox table and its indexes if they are missing; safe to run concurrently.
    fn migrate<'a>(
        pool: &'a Pool<Self>,
        table: &'a TableName,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;
}

/// A connection type a handler can take: `&mut sqlx::PgConnection`, `&mut sqlx::SqliteConnection`
/// or `&mut sqlx::MySqlConnection`.
/// It names the [`Backend`] whose [`Inbox`](crate::Inbox) the rewritten handler takes instead.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a connection an inbox can live on",
    label = "the first parameter of an `#[idempotent]` handler is the transaction's connection",
    note = "write `&mut sqlx::PgConnection`, `&mut sqlx::SqliteConnection` or `&mut sqlx::MySqlConnection`, and enable the crate's feature of the same database"
)]
pub trait HandlerConnection {
    /// The database this connection talks to.
    type Backend: Backend;
}

/// The SQL of the statements an inbox runs per message, built once from its validated table name.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct Statements {
    pub(crate) claim: Arc<str>,
    pub(crate) contains: Arc<str>,
}

/// Whether a database error is transient, whichever backend it came from.
pub(crate) fn is_retryable_database_error(error: &dyn sqlx::error::DatabaseError) -> bool {
    #[cfg(feature = "postgres")]
    if let Some(error) = error.try_downcast_ref::<sqlx::postgres::PgDatabaseError>() {
        return postgres::is_retryable_code(error.code());
    }
    #[cfg(feature = "sqlite")]
    if error
        .try_downcast_ref::<sqlx::sqlite::SqliteError>()
        .is_some()
    {
        return error
            .code()
            .is_some_and(|code| sqlite::is_retryable_code(&code));
    }
    #[cfg(feature = "mysql")]
    if let Some(error) = error.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
        return mysql::is_retryable_number(error.number());
    }
    let _ = error;
    false
}
