//! What every table's queries share: the rule that nothing is prepared behind a pooler in
//! transaction mode ([`QueryBuilder`]), the transaction of its own that a statement outside a
//! handler's transaction runs in there ([`in_own_transaction!`]), and the statements of a
//! connection itself ([`ConnectionQueries`]).
//!
//! Behind a pooler in transaction mode (see [`Statements::pooled`](super::Statements::pooled))
//! every statement is sent unprepared, and those that run outside a handler's transaction (the
//! reads, the purge's steps, the steps of a call, the operators' reads) run in a transaction of
//! their own.

use std::future::Future;

use sqlx::database::HasStatementCache;
use sqlx::{AssertSqlSafe, Database, Executor, SqlSafeStr};
use sqlx_core::transaction::TransactionManager;

/// Builds the queries of a set of statements, each prepared unless a pooler in transaction mode
/// sits in front of the database (see [`Statements::pooled`](super::Statements::pooled)): the one place that rule is kept.
pub(crate) trait QueryBuilder {
    /// Whether a pooler in transaction mode sits in front of the database.
    fn pooled(&self) -> bool;

    /// Returns `sql` as a query, prepared unless [`pooled`](Self::pooled).
    fn query<'q, DB: Database + HasStatementCache>(
        &self,
        sql: impl SqlSafeStr,
    ) -> sqlx::query::Query<'q, DB, DB::Arguments> {
        sqlx::query(sql).persistent(!self.pooled())
    }

    /// Returns `sql` as a query of rows of `O`, prepared unless [`pooled`](Self::pooled).
    fn query_as<'q, DB: Database + HasStatementCache, O>(
        &self,
        sql: impl SqlSafeStr,
    ) -> sqlx::query::QueryAs<'q, DB, O, DB::Arguments>
    where
        O: for<'r> sqlx::FromRow<'r, DB::Row>,
    {
        sqlx::query_as(sql).persistent(!self.pooled())
    }

    /// Returns `sql` as a query of one value per row, prepared unless [`pooled`](Self::pooled).
    fn query_scalar<'q, DB: Database + HasStatementCache, O>(
        &self,
        sql: impl SqlSafeStr,
    ) -> sqlx::query::QueryScalar<'q, DB, O, DB::Arguments>
    where
        (O,): for<'r> sqlx::FromRow<'r, DB::Row>,
    {
        sqlx::query_scalar(sql).persistent(!self.pooled())
    }
}

/// Begins the transaction of its own that a statement outside a handler's transaction runs in
/// behind a pooler in transaction mode (see [`Statements::pooled`](super::Statements::pooled)); nothing otherwise. Never on a
/// connection in a transaction: sqlx would not know of it, and would end it.
pub(crate) async fn begin_own_transaction<DB: Database>(
    conn: &mut DB::Connection,
    pooled: bool,
) -> Result<(), sqlx::Error> {
    if pooled {
        DB::TransactionManager::begin(conn, None).await?;
    }
    Ok(())
}

/// Ends what [`begin_own_transaction`] began: commits after `outcome` succeeded, rolls back after it failed
/// (and on a failed rollback the caller closes the connection, which ends the transaction).
pub(crate) async fn end_own_transaction<DB: Database, T>(
    conn: &mut DB::Connection,
    pooled: bool,
    outcome: Result<T, sqlx::Error>,
) -> Result<T, sqlx::Error> {
    if pooled {
        match outcome {
            Ok(_) => DB::TransactionManager::commit(conn).await?,
            Err(_) => DB::TransactionManager::rollback(conn).await?,
        }
    }
    outcome
}

/// Runs the future `$run` (which uses `$conn`) between [`begin_own_transaction`] and [`end_own_transaction`].
macro_rules! in_own_transaction {
    ($conn:ident, $statements:expr, $run:expr) => {{
        let pooled = $crate::store::QueryBuilder::pooled($statements);
        $crate::store::begin_own_transaction::<DB>($conn, pooled).await?;
        let outcome = $run.await;
        $crate::store::end_own_transaction::<DB, _>($conn, pooled, outcome).await
    }};
}
pub(crate) use in_own_transaction;

/// The rows a statement changed, which every driver reports with a method of its own.
pub trait RowsAffected {
    /// The rows a statement changed.
    fn rows(&self) -> u64;
}

macro_rules! rows_affected {
    ($($feature:literal => $result:ty),*) => {$(
        #[cfg(feature = $feature)]
        impl RowsAffected for $result {
            fn rows(&self) -> u64 {
                self.rows_affected()
            }
        }
    )*};
}
rows_affected!(
    "postgres" => sqlx::postgres::PgQueryResult,
    "sqlite" => sqlx::sqlite::SqliteQueryResult,
    "mysql" => sqlx::mysql::MySqlQueryResult
);

/// The statements of a connection itself, whatever its tables.
pub trait ConnectionQueries: Database {
    /// Runs `sql`, a statement without parameters, as it is.
    fn run<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// Forgets the statements the driver prepared on `conn` (and closes them on the server).
    fn forget_statements(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + '_;
}

impl<DB> ConnectionQueries for DB
where
    DB: Database + HasStatementCache,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::QueryResult: RowsAffected,
{
    async fn run(conn: &mut DB::Connection, sql: &str) -> Result<u64, sqlx::Error> {
        let done = conn.execute(AssertSqlSafe(sql.to_owned())).await?;
        Ok(done.rows())
    }

    async fn forget_statements(conn: &mut DB::Connection) -> Result<(), sqlx::Error> {
        sqlx::Connection::clear_cached_statements(conn).await
    }
}
