//! The calls table (`<table>_calls`): one record per call to an outside service, `pending` with a
//! lease and a fence until it is `completed` with its result.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use sqlx::database::HasStatementCache;
use sqlx::{AssertSqlSafe, Database, Encode, Executor, Type};

use super::dialect::{Dialect, Params};
use super::query::{QueryBuilder, RowsAffected, in_own_transaction};
use crate::table::TableName;

/// Identifies one call to an outside service: the message's consumer and key, and the call's name.
#[derive(Debug, Clone, Copy)]
pub struct CallId<'a> {
    pub(crate) consumer: &'a str,
    pub(crate) key: &'a [u8],
    pub(crate) name: &'a str,
}

/// A row of the calls table, times in milliseconds of the database's clock.
#[derive(Debug, sqlx::FromRow)]
pub struct CallRow {
    /// Counts the attempts that held the call: a later attempt's fence is higher.
    pub(crate) fence: i64,
    /// When the lease of the attempt holding it runs out.
    pub(crate) lease_until: i64,
    pub(crate) completed: bool,
    /// The result, once completed.
    pub(crate) result: Option<Vec<u8>>,
    /// The database's clock as it read the row.
    pub(crate) now_ms: i64,
}

/// A pending call whose lease ran out, as [`CallQueries::stuck_calls`] reads it.
#[derive(Debug, sqlx::FromRow)]
pub struct StuckRow {
    /// Read as text under another name, so that the statement's `ORDER BY` stays on the column.
    #[sqlx(rename = "consumer_text")]
    pub(crate) consumer: String,
    pub(crate) message_key: Vec<u8>,
    #[sqlx(rename = "call_name_text")]
    pub(crate) call_name: String,
    pub(crate) fence: i64,
    pub(crate) lease_until: i64,
    /// The database's clock as it read the row.
    pub(crate) now_ms: i64,
}

/// A lock that a call's record takes first, in the transaction that records the call:
/// `Ok(false)` when another transaction holds it.
pub(crate) type CallGate<'g, DB> = Box<
    dyn for<'c> FnOnce(
            &'c mut <DB as sqlx::Database>::Connection,
        )
            -> Pin<Box<dyn Future<Output = Result<bool, sqlx::Error>> + Send + 'c>>
        + Send
        + 'g,
>;

/// The statements on the calls table, built once from the inbox's validated table name.
#[derive(Debug, Clone)]
pub struct CallStatements {
    insert: Arc<str>,
    read: Arc<str>,
    take_over: Arc<str>,
    complete: Arc<str>,
    release: Arc<str>,
    /// Moves a pending call's lease end to now plus a lease, if its fence is still the one given.
    extend: Arc<str>,
    /// The rest of a pending call's live lease, in milliseconds; no row when it has none (the
    /// HTTP layer's claim, which must not run while a leased route holds the key).
    pub(crate) pending: Arc<str>,
    /// Pending calls whose lease expired, of one consumer or every one: [`StuckRow`]s.
    stuck: Arc<str>,
    /// Sent as behind a pooler in transaction mode: see [`Statements::pooled`].
    ///
    /// [`Statements::pooled`]: super::Statements::pooled
    pub(crate) pooled: bool,
}

impl QueryBuilder for CallStatements {
    fn pooled(&self) -> bool {
        self.pooled
    }
}

impl CallStatements {
    /// Builds the statements on `table`'s calls table in `dialect`.
    pub(crate) fn new(dialect: &Dialect, table: &TableName) -> Self {
        let c = table.quoted_suffixed("calls", dialect.quote);
        let Dialect {
            insert_ignore,
            on_conflict,
            now_ms,
            ..
        } = *dialect;
        let p = || Params::new(dialect);
        let call = |p: &mut Params| {
            format!(
                "consumer = {} AND message_key = {} AND call_name = {}",
                p.next(),
                p.next(),
                p.next()
            )
        };
        let insert = {
            let mut p = p();
            let (a, b, n, l) = (p.next(), p.next(), p.next(), p.next());
            format!(
                "{insert_ignore} {c} (consumer, message_key, call_name, fence, lease_until, completed, updated_at) \
                 VALUES ({a}, {b}, {n}, 1, {now_ms} + {l}, FALSE, {now_ms}){on_conflict}"
            )
        };
        let read = format!(
            "SELECT fence, lease_until, completed, result, {now_ms} AS now_ms FROM {c} WHERE {}",
            call(&mut p())
        );
        let take_over = {
            let mut p = p();
            let l = p.next();
            let which = call(&mut p);
            let f = p.next();
            format!(
                "UPDATE {c} SET fence = fence + 1, lease_until = {now_ms} + {l}, updated_at = {now_ms} \
                 WHERE {which} AND fence = {f} AND completed = FALSE AND lease_until <= {now_ms}"
            )
        };
        let complete = {
            let mut p = p();
            let r = p.next();
            let which = call(&mut p);
            let f = p.next();
            format!(
                "UPDATE {c} SET completed = TRUE, result = {r}, updated_at = {now_ms} \
                 WHERE {which} AND fence = {f} AND completed = FALSE"
            )
        };
        let release = {
            let mut p = p();
            let which = call(&mut p);
            let f = p.next();
            format!("DELETE FROM {c} WHERE {which} AND fence = {f} AND completed = FALSE")
        };
        let extend = {
            let mut p = p();
            let l = p.next();
            let which = call(&mut p);
            let f = p.next();
            format!(
                "UPDATE {c} SET lease_until = {now_ms} + {l}, updated_at = {now_ms} \
                 WHERE {which} AND fence = {f} AND completed = FALSE"
            )
        };
        let pending = format!(
            "SELECT lease_until - {now_ms} FROM {c} \
             WHERE {} AND completed = FALSE AND lease_until > {now_ms}",
            call(&mut p())
        );
        let stuck = {
            let mut p = p();
            let (any, consumer, limit) = (p.next(), p.next(), p.next());
            format!(
                "SELECT {} AS consumer_text, message_key, {} AS call_name_text, fence, lease_until, \
                 {now_ms} AS now_ms FROM {c} \
                 WHERE completed = FALSE AND lease_until < {now_ms} \
                 AND ({any} = 1 OR consumer = {consumer}) \
                 ORDER BY lease_until, consumer, message_key, call_name LIMIT {limit}",
                dialect.text("consumer"),
                dialect.text("call_name"),
            )
        };
        Self {
            insert: insert.into(),
            read: read.into(),
            take_over: take_over.into(),
            complete: complete.into(),
            release: release.into(),
            extend: extend.into(),
            pending: pending.into(),
            stuck: stuck.into(),
            pooled: false,
        }
    }
}

/// The statements on the calls table, run; implemented once for every backend.
pub trait CallQueries: Database {
    /// Records a call as pending with fence 1 unless it is recorded; `true` when this inserted it.
    fn call_insert<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a CallStatements,
        id: CallId<'a>,
        lease_ms: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// The call's record.
    fn call_read<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a CallStatements,
        id: CallId<'a>,
    ) -> impl Future<Output = Result<Option<CallRow>, sqlx::Error>> + Send + 'a;

    /// Takes over a pending call whose lease expired and whose fence is still `fence`; `true` when
    /// this call did.
    fn call_take_over<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a CallStatements,
        id: CallId<'a>,
        fence: i64,
        lease_ms: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Marks the call completed with `result` if its fence is still `fence`; `true` when it did.
    fn call_complete<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a CallStatements,
        id: CallId<'a>,
        fence: i64,
        result: &'a [u8],
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Moves the pending call's lease end to now plus `lease_ms` if its fence is still `fence`;
    /// `true` when it did.
    fn call_extend<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a CallStatements,
        id: CallId<'a>,
        fence: i64,
        lease_ms: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// The rest of the call's live lease in milliseconds, if it is pending; in the open
    /// transaction.
    fn call_pending<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a CallStatements,
        id: CallId<'a>,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send + 'a;

    /// Deletes the pending call if its fence is still `fence`; `true` when it did.
    fn call_release<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a CallStatements,
        id: CallId<'a>,
        fence: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Pending calls whose lease ran out, of `consumer` or of every consumer.
    fn stuck_calls<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a CallStatements,
        consumer: Option<&'a str>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<StuckRow>, sqlx::Error>> + Send + 'a;
}

/// The first value a fenced update binds: a lease in milliseconds (take over, extend) or a
/// result (complete).
enum Fenced<'a> {
    Lease(i64),
    Result(&'a [u8]),
}

/// Runs `sql`, one of the updates fenced by the call's `fence` (take over, complete, extend), in a
/// transaction of its own: `value`, then the call's id and fence, bound in that order. Returns
/// whether it changed the call's row (false: another attempt holds the call now).
async fn fenced_update<DB>(
    conn: &mut DB::Connection,
    statements: &CallStatements,
    sql: &str,
    value: Fenced<'_>,
    id: CallId<'_>,
    fence: i64,
) -> Result<bool, sqlx::Error>
where
    DB: Database + HasStatementCache,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> &'q [u8]: Encode<'q, DB> + Type<DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    DB::QueryResult: RowsAffected,
{
    let done = in_own_transaction!(conn, statements, {
        let query = statements.query(AssertSqlSafe(sql.to_owned()));
        let query = match value {
            Fenced::Lease(lease_ms) => query.bind(lease_ms),
            Fenced::Result(result) => query.bind(result),
        };
        query
            .bind(id.consumer)
            .bind(id.key)
            .bind(id.name)
            .bind(fence)
            .execute(&mut *conn)
    })?;
    Ok(done.rows() == 1)
}

impl<DB> CallQueries for DB
where
    DB: Database + HasStatementCache,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> &'q [u8]: Encode<'q, DB> + Type<DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'r> (i64,): sqlx::FromRow<'r, DB::Row>,
    for<'r> CallRow: sqlx::FromRow<'r, DB::Row>,
    for<'r> StuckRow: sqlx::FromRow<'r, DB::Row>,
    DB::QueryResult: RowsAffected,
{
    async fn call_insert(
        conn: &mut DB::Connection,
        statements: &CallStatements,
        id: CallId<'_>,
        lease_ms: i64,
    ) -> Result<bool, sqlx::Error> {
        let done = in_own_transaction!(
            conn,
            statements,
            statements
                .query(AssertSqlSafe(statements.insert.clone()))
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
        statements: &CallStatements,
        id: CallId<'_>,
    ) -> Result<Option<CallRow>, sqlx::Error> {
        in_own_transaction!(
            conn,
            statements,
            statements
                .query_as(AssertSqlSafe(statements.read.clone()))
                .bind(id.consumer)
                .bind(id.key)
                .bind(id.name)
                .fetch_optional(&mut *conn)
        )
    }

    async fn call_take_over(
        conn: &mut DB::Connection,
        statements: &CallStatements,
        id: CallId<'_>,
        fence: i64,
        lease_ms: i64,
    ) -> Result<bool, sqlx::Error> {
        fenced_update(
            conn,
            statements,
            &statements.take_over,
            Fenced::Lease(lease_ms),
            id,
            fence,
        )
        .await
    }

    async fn call_complete(
        conn: &mut DB::Connection,
        statements: &CallStatements,
        id: CallId<'_>,
        fence: i64,
        result: &[u8],
    ) -> Result<bool, sqlx::Error> {
        fenced_update(
            conn,
            statements,
            &statements.complete,
            Fenced::Result(result),
            id,
            fence,
        )
        .await
    }

    async fn call_extend(
        conn: &mut DB::Connection,
        statements: &CallStatements,
        id: CallId<'_>,
        fence: i64,
        lease_ms: i64,
    ) -> Result<bool, sqlx::Error> {
        fenced_update(
            conn,
            statements,
            &statements.extend,
            Fenced::Lease(lease_ms),
            id,
            fence,
        )
        .await
    }

    async fn call_pending(
        conn: &mut DB::Connection,
        statements: &CallStatements,
        id: CallId<'_>,
    ) -> Result<Option<i64>, sqlx::Error> {
        statements
            .query_scalar(AssertSqlSafe(statements.pending.clone()))
            .bind(id.consumer)
            .bind(id.key)
            .bind(id.name)
            .fetch_optional(conn)
            .await
    }

    async fn call_release(
        conn: &mut DB::Connection,
        statements: &CallStatements,
        id: CallId<'_>,
        fence: i64,
    ) -> Result<bool, sqlx::Error> {
        let done = statements
            .query(AssertSqlSafe(statements.release.clone()))
            .bind(id.consumer)
            .bind(id.key)
            .bind(id.name)
            .bind(fence)
            .execute(conn)
            .await?;
        Ok(done.rows() == 1)
    }

    async fn stuck_calls(
        conn: &mut DB::Connection,
        statements: &CallStatements,
        consumer: Option<&str>,
        limit: i64,
    ) -> Result<Vec<StuckRow>, sqlx::Error> {
        in_own_transaction!(
            conn,
            statements,
            statements
                .query_as(AssertSqlSafe(statements.stuck.clone()))
                .bind(i64::from(consumer.is_none()))
                .bind(consumer.unwrap_or(""))
                .bind(limit)
                .fetch_all(&mut *conn)
        )
    }
}
