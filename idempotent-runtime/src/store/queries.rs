//! The statements that are the same on every backend, run by one generic implementation.
//!
//! `Queries` is implemented once, for every database whose driver can run them; [`Backend`]
//! requires it, so code generic over a backend calls these without repeating the driver's bounds.
//!
//! Behind a pooler in transaction mode ([`Statements::pooled`]) every statement here is sent
//! unprepared, and those that run outside a handler's transaction (the reads, the purge's steps,
//! the steps of a call, the operators' reads) run in a transaction of their own.
//!
//! [`Backend`]: super::Backend

use std::future::Future;

use sqlx::database::HasStatementCache;
use sqlx::{AssertSqlSafe, Database, Decode, Encode, Executor, SqlSafeStr, Type};
use sqlx_core::transaction::TransactionManager;

use super::private::Store;
use super::statements::{
    AuditRow, Bind, CallId, CallRow, InspectRow, ListRow, PurgeSql, Statements, StoredRow, StuckRow,
};

/// What [`Queries::stats`] reads: rows per consumer, calls per consumer, horizons.
pub(crate) type StatsRows = (
    Vec<(String, i64, Option<i64>)>,
    Vec<(String, i64, i64)>,
    Vec<(String, i64)>,
);

/// Binds a purge statement's values in the order it names them.
macro_rules! bind_purge {
    ($query:expr, $sql:expr, $cutoff:expr, $consumers:expr, $batch:expr) => {{
        let mut query = $query;
        for bind in &$sql.binds {
            match bind {
                Bind::Cutoff => query = query.bind($cutoff),
                Bind::Consumers => {
                    for consumer in $consumers {
                        query = query.bind(consumer.as_str());
                    }
                }
                Bind::Limit => query = query.bind($batch),
            }
        }
        query
    }};
}

/// Builds the queries of a set of statements, each prepared unless a pooler in transaction mode
/// sits in front of the database (see [`Statements::pooled`]): the one place that rule is kept.
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

impl QueryBuilder for Statements {
    fn pooled(&self) -> bool {
        self.pooled
    }
}

/// Begins the transaction of its own that a statement outside a handler's transaction runs in
/// behind a pooler in transaction mode (see [`Statements::pooled`]); nothing otherwise. Never on a
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
        $crate::store::begin_own_transaction::<DB>($conn, $statements.pooled).await?;
        let outcome = $run.await;
        $crate::store::end_own_transaction::<DB, _>($conn, $statements.pooled, outcome).await
    }};
}
pub(crate) use in_own_transaction;

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

    /// Deletes the claim of `(consumer, key)` this transaction inserted: its message failed, and a
    /// redelivery must find the key free.
    fn forget_claim<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        consumer: &'a str,
        key: &'a [u8],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Stores the body's serialized response on the claimed row, in the handler's transaction.
    fn set_response<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        consumer: &'a str,
        key: &'a [u8],
        response: &'a [u8],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// The committed row of `(consumer, key)`, if any.
    fn stored<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        consumer: &'a str,
        key: &'a [u8],
    ) -> impl Future<Output = Result<Option<StoredRow>, sqlx::Error>> + Send + 'a;

    /// The database's clock, in milliseconds since the Unix epoch.
    fn now_ms<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + 'a;

    /// Runs a statement of the purge (see [`Statements::purge`]); the rows it changed.
    fn purge_step<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        sql: &'a PurgeSql,
        cutoff: i64,
        consumers: &'a [String],
        batch: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// The consumers a purge pass finds expired rows of (see [`Statements::purge`]).
    fn purge_consumers<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        sql: &'a PurgeSql,
        cutoff: i64,
        consumers: &'a [String],
    ) -> impl Future<Output = Result<Vec<String>, sqlx::Error>> + Send + 'a;

    /// Moves `consumer`'s horizon forward to `until`.
    fn record_horizon<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        consumer: &'a str,
        until: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Runs a count of the purge's dry run: `(consumer, rows)`.
    fn purge_count<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        sql: &'a PurgeSql,
        cutoff: i64,
        consumers: &'a [String],
    ) -> impl Future<Output = Result<Vec<(String, i64)>, sqlx::Error>> + Send + 'a;

    /// `consumer`'s purge horizon, in milliseconds of the database's clock.
    fn horizon<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        consumer: &'a str,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send + 'a;

    /// The inbox row of `(consumer, key)`.
    fn inspect<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        consumer: &'a str,
        key: &'a [u8],
    ) -> impl Future<Output = Result<Option<InspectRow>, sqlx::Error>> + Send + 'a;

    /// A page of `consumer`'s rows processed in `[from, until)` (milliseconds), after the row
    /// `after` (its time and key), in order.
    fn list<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        consumer: &'a str,
        range: (i64, i64),
        after: (i64, &'a [u8]),
        limit: i64,
    ) -> impl Future<Output = Result<Vec<ListRow>, sqlx::Error>> + Send + 'a;

    /// Pending calls whose lease ran out, of `consumer` or of every consumer.
    fn stuck_calls<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        consumer: Option<&'a str>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<StuckRow>, sqlx::Error>> + Send + 'a;

    /// Deletes the inbox row of `(consumer, key)`; whether there was one.
    fn forget<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        consumer: &'a str,
        key: &'a [u8],
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Writes the audit row of a forgotten message.
    fn audit_insert<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        consumer: &'a str,
        digest: &'a str,
        reason: &'a str,
        processed_ms: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// The newest audit rows, of `consumer` or of every consumer.
    fn audit_read<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        consumer: Option<&'a str>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<AuditRow>, sqlx::Error>> + Send + 'a;

    /// Per consumer: `(consumer, rows, oldest_ms)`, `(consumer, pending, stuck)` calls and
    /// `(consumer, horizon_ms)`.
    fn stats<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
    ) -> impl Future<Output = Result<StatsRows, sqlx::Error>> + Send + 'a;

    /// The newest schema version recorded, if any.
    fn schema_version<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send + 'a;

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

    /// Moves the pending call's lease end to now plus `lease_ms` if its fence is still `fence`;
    /// `true` when it did.
    fn call_extend<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        id: CallId<'a>,
        fence: i64,
        lease_ms: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// The rest of the call's live lease in milliseconds, if it is pending; in the open
    /// transaction.
    fn call_pending<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        id: CallId<'a>,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send + 'a;

    /// Stores `response` on the inbox row of `(consumer, key)` if it has none, or has `tried`, in
    /// the open transaction; `true` when it did.
    fn fill_response<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        consumer: &'a str,
        key: &'a [u8],
        response: &'a [u8],
        tried: &'a [u8],
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Deletes the pending call if its fence is still `fence`; `true` when it did.
    fn call_release<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        id: CallId<'a>,
        fence: i64,
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
    for<'r> String: Decode<'r, DB> + Type<DB>,
    for<'r> Vec<u8>: Decode<'r, DB> + Type<DB>,
    for<'r> Option<i64>: Decode<'r, DB>,
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
        let done = statements
            .query(AssertSqlSafe(statements.claim.clone()))
            .bind(consumer)
            .bind(key)
            .bind(fingerprint)
            .execute(conn)
            .await?;
        Ok(done.rows() == 1)
    }

    async fn forget_claim(
        conn: &mut DB::Connection,
        statements: &Statements,
        consumer: &str,
        key: &[u8],
    ) -> Result<(), sqlx::Error> {
        statements
            .query(AssertSqlSafe(statements.forget_claim.clone()))
            .bind(consumer)
            .bind(key)
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn set_response(
        conn: &mut DB::Connection,
        statements: &Statements,
        consumer: &str,
        key: &[u8],
        response: &[u8],
    ) -> Result<(), sqlx::Error> {
        statements
            .query(AssertSqlSafe(statements.set_response.clone()))
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
        in_own_transaction!(
            conn,
            statements,
            statements
                .query_as(AssertSqlSafe(statements.stored.clone()))
                .bind(consumer)
                .bind(key)
                .fetch_optional(&mut *conn)
        )
    }

    async fn now_ms(
        conn: &mut DB::Connection,
        statements: &Statements,
    ) -> Result<i64, sqlx::Error> {
        in_own_transaction!(
            conn,
            statements,
            statements
                .query_scalar(AssertSqlSafe(statements.now.clone()))
                .fetch_one(&mut *conn)
        )
    }

    async fn purge_step(
        conn: &mut DB::Connection,
        statements: &Statements,
        sql: &PurgeSql,
        cutoff: i64,
        consumers: &[String],
        batch: i64,
    ) -> Result<u64, sqlx::Error> {
        let query = statements.query(AssertSqlSafe(sql.sql.clone()));
        let query = bind_purge!(query, sql, cutoff, consumers, batch);
        Ok(in_own_transaction!(conn, statements, query.execute(&mut *conn))?.rows())
    }

    async fn purge_count(
        conn: &mut DB::Connection,
        statements: &Statements,
        sql: &PurgeSql,
        cutoff: i64,
        consumers: &[String],
    ) -> Result<Vec<(String, i64)>, sqlx::Error> {
        let query = statements.query_as(AssertSqlSafe(sql.sql.clone()));
        let query = bind_purge!(query, sql, cutoff, consumers, 0i64);
        in_own_transaction!(conn, statements, query.fetch_all(&mut *conn))
    }

    async fn purge_consumers(
        conn: &mut DB::Connection,
        statements: &Statements,
        sql: &PurgeSql,
        cutoff: i64,
        consumers: &[String],
    ) -> Result<Vec<String>, sqlx::Error> {
        let query = statements.query_scalar(AssertSqlSafe(sql.sql.clone()));
        let query = bind_purge!(query, sql, cutoff, consumers, 0i64);
        in_own_transaction!(conn, statements, query.fetch_all(&mut *conn))
    }

    async fn record_horizon(
        conn: &mut DB::Connection,
        statements: &Statements,
        consumer: &str,
        until: i64,
    ) -> Result<(), sqlx::Error> {
        in_own_transaction!(
            conn,
            statements,
            statements
                .query(AssertSqlSafe(statements.record_horizon.clone()))
                .bind(consumer)
                .bind(until)
                .execute(&mut *conn)
        )?;
        Ok(())
    }

    async fn horizon(
        conn: &mut DB::Connection,
        statements: &Statements,
        consumer: &str,
    ) -> Result<Option<i64>, sqlx::Error> {
        statements
            .query_scalar(AssertSqlSafe(statements.horizon.clone()))
            .bind(consumer)
            .fetch_optional(conn)
            .await
    }

    async fn inspect(
        conn: &mut DB::Connection,
        statements: &Statements,
        consumer: &str,
        key: &[u8],
    ) -> Result<Option<InspectRow>, sqlx::Error> {
        statements
            .query_as(AssertSqlSafe(statements.inspect.clone()))
            .bind(consumer)
            .bind(key)
            .fetch_optional(conn)
            .await
    }

    async fn list(
        conn: &mut DB::Connection,
        statements: &Statements,
        consumer: &str,
        (from, until): (i64, i64),
        (at, key): (i64, &[u8]),
        limit: i64,
    ) -> Result<Vec<ListRow>, sqlx::Error> {
        in_own_transaction!(
            conn,
            statements,
            statements
                .query_as(AssertSqlSafe(statements.list.clone()))
                .bind(consumer)
                .bind(from)
                .bind(until)
                .bind(at)
                .bind(at)
                .bind(key)
                .bind(limit)
                .fetch_all(&mut *conn)
        )
    }

    async fn stuck_calls(
        conn: &mut DB::Connection,
        statements: &Statements,
        consumer: Option<&str>,
        limit: i64,
    ) -> Result<Vec<StuckRow>, sqlx::Error> {
        in_own_transaction!(
            conn,
            statements,
            statements
                .query_as(AssertSqlSafe(statements.stuck_calls.clone()))
                .bind(i64::from(consumer.is_none()))
                .bind(consumer.unwrap_or(""))
                .bind(limit)
                .fetch_all(&mut *conn)
        )
    }

    async fn forget(
        conn: &mut DB::Connection,
        statements: &Statements,
        consumer: &str,
        key: &[u8],
    ) -> Result<bool, sqlx::Error> {
        let done = statements
            .query(AssertSqlSafe(statements.forget.clone()))
            .bind(consumer)
            .bind(key)
            .execute(conn)
            .await?;
        Ok(done.rows() == 1)
    }

    async fn audit_insert(
        conn: &mut DB::Connection,
        statements: &Statements,
        consumer: &str,
        digest: &str,
        reason: &str,
        processed_ms: i64,
    ) -> Result<(), sqlx::Error> {
        statements
            .query(AssertSqlSafe(statements.audit_insert.clone()))
            .bind(consumer)
            .bind(digest)
            .bind(reason)
            .bind(processed_ms)
            .execute(conn)
            .await?;
        Ok(())
    }

    async fn audit_read(
        conn: &mut DB::Connection,
        statements: &Statements,
        consumer: Option<&str>,
        limit: i64,
    ) -> Result<Vec<AuditRow>, sqlx::Error> {
        in_own_transaction!(
            conn,
            statements,
            statements
                .query_as(AssertSqlSafe(statements.audit_read.clone()))
                .bind(i64::from(consumer.is_none()))
                .bind(consumer.unwrap_or(""))
                .bind(limit)
                .fetch_all(&mut *conn)
        )
    }

    async fn stats(
        conn: &mut DB::Connection,
        statements: &Statements,
    ) -> Result<StatsRows, sqlx::Error> {
        in_own_transaction!(conn, statements, async {
            let rows = statements
                .query_as(AssertSqlSafe(statements.stats_rows.clone()))
                .fetch_all(&mut *conn)
                .await?;
            let calls = statements
                .query_as(AssertSqlSafe(statements.stats_calls.clone()))
                .fetch_all(&mut *conn)
                .await?;
            let horizons = statements
                .query_as(AssertSqlSafe(statements.stats_horizons.clone()))
                .fetch_all(&mut *conn)
                .await?;
            Ok((rows, calls, horizons))
        })
    }

    async fn schema_version(
        conn: &mut DB::Connection,
        statements: &Statements,
    ) -> Result<Option<i64>, sqlx::Error> {
        statements
            .query_scalar(AssertSqlSafe(statements.schema_version.clone()))
            .fetch_one(conn)
            .await
    }

    async fn call_insert(
        conn: &mut DB::Connection,
        statements: &Statements,
        id: CallId<'_>,
        lease_ms: i64,
    ) -> Result<bool, sqlx::Error> {
        let done = in_own_transaction!(
            conn,
            statements,
            statements
                .query(AssertSqlSafe(statements.call_insert.clone()))
                .bind(id.consumer)
                .bind(id.key)
                .bind(id.name)
                .bind(lease_ms)
                .execute(&mut *conn)
        )?;
        Ok(done.rows() == 1)
    }

    async fn call_read(
        conn: &mut DB::Connection,
        statements: &Statements,
        id: CallId<'_>,
    ) -> Result<Option<CallRow>, sqlx::Error> {
        in_own_transaction!(
            conn,
            statements,
            statements
                .query_as(AssertSqlSafe(statements.call_read.clone()))
                .bind(id.consumer)
                .bind(id.key)
                .bind(id.name)
                .fetch_optional(&mut *conn)
        )
    }

    async fn call_take_over(
        conn: &mut DB::Connection,
        statements: &Statements,
        id: CallId<'_>,
        fence: i64,
        lease_ms: i64,
    ) -> Result<bool, sqlx::Error> {
        let done = in_own_transaction!(
            conn,
            statements,
            statements
                .query(AssertSqlSafe(statements.call_take_over.clone()))
                .bind(lease_ms)
                .bind(id.consumer)
                .bind(id.key)
                .bind(id.name)
                .bind(fence)
                .execute(&mut *conn)
        )?;
        Ok(done.rows() == 1)
    }

    async fn call_complete(
        conn: &mut DB::Connection,
        statements: &Statements,
        id: CallId<'_>,
        fence: i64,
        result: &[u8],
    ) -> Result<bool, sqlx::Error> {
        let done = in_own_transaction!(
            conn,
            statements,
            statements
                .query(AssertSqlSafe(statements.call_complete.clone()))
                .bind(result)
                .bind(id.consumer)
                .bind(id.key)
                .bind(id.name)
                .bind(fence)
                .execute(&mut *conn)
        )?;
        Ok(done.rows() == 1)
    }

    async fn call_extend(
        conn: &mut DB::Connection,
        statements: &Statements,
        id: CallId<'_>,
        fence: i64,
        lease_ms: i64,
    ) -> Result<bool, sqlx::Error> {
        let done = in_own_transaction!(
            conn,
            statements,
            statements
                .query(AssertSqlSafe(statements.call_extend.clone()))
                .bind(lease_ms)
                .bind(id.consumer)
                .bind(id.key)
                .bind(id.name)
                .bind(fence)
                .execute(&mut *conn)
        )?;
        Ok(done.rows() == 1)
    }

    async fn call_pending(
        conn: &mut DB::Connection,
        statements: &Statements,
        id: CallId<'_>,
    ) -> Result<Option<i64>, sqlx::Error> {
        statements
            .query_scalar(AssertSqlSafe(statements.call_pending.clone()))
            .bind(id.consumer)
            .bind(id.key)
            .bind(id.name)
            .fetch_optional(conn)
            .await
    }

    async fn fill_response(
        conn: &mut DB::Connection,
        statements: &Statements,
        consumer: &str,
        key: &[u8],
        response: &[u8],
        tried: &[u8],
    ) -> Result<bool, sqlx::Error> {
        let done = statements
            .query(AssertSqlSafe(statements.fill_response.clone()))
            .bind(response)
            .bind(consumer)
            .bind(key)
            .bind(tried)
            .execute(conn)
            .await?;
        Ok(done.rows() == 1)
    }

    async fn call_release(
        conn: &mut DB::Connection,
        statements: &Statements,
        id: CallId<'_>,
        fence: i64,
    ) -> Result<bool, sqlx::Error> {
        let done = statements
            .query(AssertSqlSafe(statements.call_release.clone()))
            .bind(id.consumer)
            .bind(id.key)
            .bind(id.name)
            .bind(fence)
            .execute(conn)
            .await?;
        Ok(done.rows() == 1)
    }
}
