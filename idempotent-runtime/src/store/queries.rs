//! The statements that are the same on every backend, run by one generic implementation.
//!
//! `Queries` is implemented once, for every database whose driver can run them; [`Backend`]
//! requires it, so code generic over a backend calls these without repeating the driver's bounds.
//!
//! Behind a pooler in transaction mode ([`Statements::pooled`]) every statement here is sent
//! unprepared, and those that run outside a handler's transaction (the reads, the purge batches,
//! the steps of a call) run in a transaction of their own.
//!
//! [`Backend`]: super::Backend

use std::future::Future;

use sqlx::{AssertSqlSafe, Database, Decode, Encode, Executor, Type};
use sqlx_core::transaction::TransactionManager;

use super::private::Store;
use super::statements::{CallId, CallRow, Statements, StoredRow};

/// The shared statements; see the module docs.
pub trait Queries: Store {
    /// Runs `sql`, a statement without parameters, as it is.
    fn run<'a>(
        conn: &'a mut Self::Connection,
        sql: &'a str,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// Forgets the statements the driver prepared on `conn` (and closes them on the server).
    fn forget_statements(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + '_;

    /// Inserts `(consumer, key, fingerprint)` unless the key is there, in the open transaction;
    /// `true` when this call inserted it. A concurrent uncommitted insert of the same key makes
    /// this wait for that transaction to end.
    fn insert_key<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        consumer: &'a str,
        key: &'a [u8],
        fingerprint: Option<&'a [u8]>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Stores the body's serialized response on the claimed row, in the handler's transaction.
    fn set_response<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        consumer: &'a str,
        key: &'a [u8],
        response: &'a [u8],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// The committed row of `(consumer, key)`, if any. Runs outside a handler's transaction.
    fn stored<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        consumer: &'a str,
        key: &'a [u8],
    ) -> impl Future<Output = Result<Option<StoredRow>, sqlx::Error>> + Send + 'a;

    /// Deletes one batch of expired rows with `statement` (see [`Statements::purge`]), in a
    /// transaction of its own.
    fn purge_batch<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        statement: &'a str,
        retention_ms: i64,
        consumers: &'a [String],
        batch: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// Records a call as pending with fence 1 unless it is recorded; `true` when this inserted it.
    fn call_insert<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        id: CallId<'a>,
        lease_ms: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// The call's record.
    fn call_read<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        id: CallId<'a>,
    ) -> impl Future<Output = Result<Option<CallRow>, sqlx::Error>> + Send + 'a;

    /// Takes over a pending call whose lease expired and whose fence is still `fence`; `true` when
    /// this call did.
    fn call_take_over<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        id: CallId<'a>,
        fence: i64,
        lease_ms: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Marks the call completed with `result` if its fence is still `fence`; `true` when it did.
    fn call_complete<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        id: CallId<'a>,
        fence: i64,
        result: &'a [u8],
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;
}

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

/// Begins the transaction of its own that a statement outside a handler's transaction runs in
/// behind a pooler in transaction mode; nothing otherwise.
async fn begin_alone<DB: Database>(
    conn: &mut DB::Connection,
    statements: &Statements,
) -> Result<(), sqlx::Error> {
    if statements.pooled {
        <DB as Database>::TransactionManager::begin(conn, None).await?;
    }
    Ok(())
}

/// Ends what [`begin_alone`] began: commits after `outcome` succeeded, rolls back after it failed.
async fn end_alone<DB: Database, T>(
    conn: &mut DB::Connection,
    statements: &Statements,
    outcome: Result<T, sqlx::Error>,
) -> Result<T, sqlx::Error> {
    if !statements.pooled {
        return outcome;
    }
    match outcome {
        Ok(value) => {
            <DB as Database>::TransactionManager::commit(conn).await?;
            Ok(value)
        }
        Err(error) => {
            // On a failed rollback the caller closes the connection, which ends the transaction.
            <DB as Database>::TransactionManager::rollback(conn).await?;
            Err(error)
        }
    }
}

impl<DB> Queries for DB
where
    DB: Store,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> &'q [u8]: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q [u8]>: Encode<'q, DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'r> Option<Vec<u8>>: Decode<'r, DB> + Type<DB>,
    for<'r> i64: Decode<'r, DB>,
    for<'r> bool: Decode<'r, DB> + Type<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
    DB: sqlx::database::HasStatementCache,
    DB::QueryResult: RowsAffected,
{
    async fn run(conn: &mut DB::Connection, sql: &str) -> Result<u64, sqlx::Error> {
        let done = conn.execute(AssertSqlSafe(sql.to_owned())).await?;
        Ok(done.rows())
    }

    async fn forget_statements(conn: &mut DB::Connection) -> Result<(), sqlx::Error> {
        sqlx::Connection::clear_cached_statements(conn).await
    }

    async fn insert_key(
        conn: &mut DB::Connection,
        statements: &Statements,
        consumer: &str,
        key: &[u8],
        fingerprint: Option<&[u8]>,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(AssertSqlSafe(statements.claim.clone()))
            .persistent(!statements.pooled)
            .bind(consumer)
            .bind(key)
            .bind(fingerprint)
            .execute(conn)
            .await?;
        Ok(done.rows() == 1)
    }

    async fn set_response(
        conn: &mut DB::Connection,
        statements: &Statements,
        consumer: &str,
        key: &[u8],
        response: &[u8],
    ) -> Result<(), sqlx::Error> {
        sqlx::query(AssertSqlSafe(statements.set_response.clone()))
            .persistent(!statements.pooled)
            .bind(response)
            .bind(consumer)
            .bind(key)
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn stored(
        conn: &mut DB::Connection,
        statements: &Statements,
        consumer: &str,
        key: &[u8],
    ) -> Result<Option<StoredRow>, sqlx::Error> {
        begin_alone::<DB>(conn, statements).await?;
        let row = sqlx::query_as(AssertSqlSafe(statements.stored.clone()))
            .persistent(!statements.pooled)
            .bind(consumer)
            .bind(key)
            .fetch_optional(&mut *conn)
            .await;
        end_alone::<DB, _>(conn, statements, row).await
    }

    async fn purge_batch(
        conn: &mut DB::Connection,
        statements: &Statements,
        statement: &str,
        retention_ms: i64,
        consumers: &[String],
        batch: i64,
    ) -> Result<u64, sqlx::Error> {
        let mut query = sqlx::query(AssertSqlSafe(statement.to_owned()))
            .persistent(!statements.pooled)
            .bind(retention_ms);
        for consumer in consumers {
            query = query.bind(consumer.as_str());
        }
        begin_alone::<DB>(conn, statements).await?;
        let done = query.bind(batch).execute(&mut *conn).await;
        let done = end_alone::<DB, _>(conn, statements, done).await?;
        Ok(done.rows())
    }

    async fn call_insert(
        conn: &mut DB::Connection,
        statements: &Statements,
        id: CallId<'_>,
        lease_ms: i64,
    ) -> Result<bool, sqlx::Error> {
        begin_alone::<DB>(conn, statements).await?;
        let done = sqlx::query(AssertSqlSafe(statements.call_insert.clone()))
            .persistent(!statements.pooled)
            .bind(id.consumer)
            .bind(id.key)
            .bind(id.name)
            .bind(lease_ms)
            .execute(&mut *conn)
            .await;
        let done = end_alone::<DB, _>(conn, statements, done).await?;
        Ok(done.rows() == 1)
    }

    async fn call_read(
        conn: &mut DB::Connection,
        statements: &Statements,
        id: CallId<'_>,
    ) -> Result<Option<CallRow>, sqlx::Error> {
        begin_alone::<DB>(conn, statements).await?;
        let row = sqlx::query_as(AssertSqlSafe(statements.call_read.clone()))
            .persistent(!statements.pooled)
            .bind(id.consumer)
            .bind(id.key)
            .bind(id.name)
            .fetch_optional(&mut *conn)
            .await;
        end_alone::<DB, _>(conn, statements, row).await
    }

    async fn call_take_over(
        conn: &mut DB::Connection,
        statements: &Statements,
        id: CallId<'_>,
        fence: i64,
        lease_ms: i64,
    ) -> Result<bool, sqlx::Error> {
        begin_alone::<DB>(conn, statements).await?;
        let done = sqlx::query(AssertSqlSafe(statements.call_take_over.clone()))
            .persistent(!statements.pooled)
            .bind(lease_ms)
            .bind(id.consumer)
            .bind(id.key)
            .bind(id.name)
            .bind(fence)
            .execute(&mut *conn)
            .await;
        let done = end_alone::<DB, _>(conn, statements, done).await?;
        Ok(done.rows() == 1)
    }

    async fn call_complete(
        conn: &mut DB::Connection,
        statements: &Statements,
        id: CallId<'_>,
        fence: i64,
        result: &[u8],
    ) -> Result<bool, sqlx::Error> {
        begin_alone::<DB>(conn, statements).await?;
        let done = sqlx::query(AssertSqlSafe(statements.call_complete.clone()))
            .persistent(!statements.pooled)
            .bind(result)
            .bind(id.consumer)
            .bind(id.key)
            .bind(id.name)
            .bind(fence)
            .execute(&mut *conn)
            .await;
        let done = end_alone::<DB, _>(conn, statements, done).await?;
        Ok(done.rows() == 1)
    }
}
