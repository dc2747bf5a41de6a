//! The inbox table (`<table>`): the claim of a key, the row a duplicate reads, the stored
//! response, and what operators read and forget of it.

use std::future::Future;
use std::sync::Arc;

use sqlx::database::HasStatementCache;
use sqlx::{AssertSqlSafe, Database, Encode, Executor, Type};

use super::dialect::{Dialect, Params};
use super::query::{QueryBuilder, RowsAffected, in_own_transaction};
use crate::table::TableName;

/// What a duplicate's inbox row holds.
#[derive(Debug, Default, sqlx::FromRow)]
pub struct StoredRow {
    /// The response the first call stored, if it stored one.
    pub(crate) response: Option<Vec<u8>>,
    /// The payload fingerprint the first call stored, if it had one.
    pub(crate) fingerprint: Option<Vec<u8>>,
}

/// An inbox row as [`InboxQueries::inspect`] reads it.
#[derive(Debug, sqlx::FromRow)]
pub struct InspectRow {
    /// When it was processed, in milliseconds since the Unix epoch.
    pub(crate) processed_ms: i64,
    pub(crate) response: Option<Vec<u8>>,
    pub(crate) fingerprint: Option<Vec<u8>>,
}

/// An inbox row as [`InboxQueries::list`] reads it.
#[derive(Debug, sqlx::FromRow)]
pub struct ListRow {
    pub(crate) message_key: Vec<u8>,
    /// When it was processed, in milliseconds since the Unix epoch.
    pub(crate) processed_ms: i64,
    pub(crate) fingerprint: Option<Vec<u8>>,
    /// The stored response's length in bytes, if it has one.
    pub(crate) response_len: Option<i64>,
}

/// The statements on the inbox table, built once from its validated name.
#[derive(Debug, Clone)]
pub struct InboxStatements {
    /// The quoted table name (what [`table_sql`](Self::table_sql) fills in).
    #[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
    table: String,
    /// Inserts a key unless it is there.
    pub(crate) claim: Arc<str>,
    /// The response and fingerprint of a key's row: [`StoredRow`].
    stored: Arc<str>,
    set_response: Arc<str>,
    /// Whether [`set_response`](InboxStore::set_response)'s row proves the inbox's transaction.
    proves_transaction: bool,
    forget_claim: Arc<str>,
    /// Replaces the response of an inbox row that has none, or has the one given (the HTTP
    /// layer's answer for a request whose handler committed the key itself).
    fill_response: Arc<str>,
    /// One inbox row: [`InspectRow`].
    inspect: Arc<str>,
    /// A page of a consumer's rows in a time range, after a cursor: [`ListRow`]s.
    list: Arc<str>,
    /// Deletes one inbox row.
    forget: Arc<str>,
    /// Sent as behind a pooler in transaction mode: see [`Statements::pooled`].
    ///
    /// [`Statements::pooled`]: super::Statements::pooled
    pub(crate) pooled: bool,
}

impl QueryBuilder for InboxStatements {
    fn pooled(&self) -> bool {
        self.pooled
    }
}

impl InboxStatements {
    /// Builds the statements on `table` in `dialect`.
    pub(crate) fn new(dialect: &Dialect, table: &TableName) -> Self {
        let t = table.quoted(dialect.quote);
        let Dialect {
            insert_ignore,
            on_conflict,
            processed_now,
            processed_ms,
            int,
            time_of_ms,
            own_transaction,
            ..
        } = *dialect;
        let p = || Params::new(dialect);
        let claim = {
            let mut p = p();
            let (a, b, f) = (p.next(), p.next(), p.next());
            format!(
                "{insert_ignore} {t} (consumer, message_key, fingerprint, processed_at) \
                 VALUES ({a}, {b}, {f}, {processed_now}){on_conflict}"
            )
        };
        let stored = format!("SELECT response, fingerprint FROM {t} WHERE {}", p().key());
        let forget_claim = format!("DELETE FROM {t} WHERE {}", p().key());
        let set_response = {
            let mut p = p();
            let r = p.next();
            let proof = own_transaction.map_or_else(String::new, |own| format!(" AND {own}"));
            format!("UPDATE {t} SET response = {r} WHERE {}{proof}", p.key())
        };
        let inspect = format!(
            "SELECT {processed_ms} AS processed_ms, response, fingerprint FROM {t} WHERE {}",
            p().key()
        );
        let list = {
            let mut p = p();
            let (consumer, from, until) = (p.next(), p.next(), p.next());
            let (at, at_again, after, limit) = (p.next(), p.next(), p.next(), p.next());
            let from = time_of_ms.replace("{}", &from);
            let until = time_of_ms.replace("{}", &until);
            format!(
                "SELECT message_key, {processed_ms} AS processed_ms, fingerprint, \
                 CAST(LENGTH(response) AS {int}) AS response_len \
                 FROM {t} WHERE consumer = {consumer} \
                 AND processed_at >= {from} AND processed_at < {until} \
                 AND ({processed_ms} > {at} OR ({processed_ms} = {at_again} AND message_key > {after})) \
                 ORDER BY {processed_ms}, message_key LIMIT {limit}"
            )
        };
        let forget = format!("DELETE FROM {t} WHERE {}", p().key());
        let fill_response = {
            let mut p = p();
            let r = p.next();
            let which = p.key();
            let tried = p.next();
            format!(
                "UPDATE {t} SET response = {r} WHERE {which} \
                 AND (response IS NULL OR response = {tried})"
            )
        };
        Self {
            table: t,
            claim: claim.into(),
            stored: stored.into(),
            set_response: set_response.into(),
            proves_transaction: own_transaction.is_some(),
            forget_claim: forget_claim.into(),
            fill_response: fill_response.into(),
            inspect: inspect.into(),
            list: list.into(),
            forget: forget.into(),
            pooled: false,
        }
    }

    /// `template` with `{t}` replaced by the quoted table name.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    pub(crate) fn table_sql(&self, template: &str) -> String {
        template.replace("{t}", &self.table)
    }

    /// The quoted table name.
    #[cfg(all(feature = "http", feature = "postgres"))]
    pub(crate) fn quoted_table(&self) -> &str {
        &self.table
    }
}

/// The statements on the inbox table, run; implemented once for every backend.
pub trait InboxQueries: Database {
    /// Inserts `(consumer, key, fingerprint)` unless the key is there, in the open transaction;
    /// `true` when this call inserted it. A concurrent uncommitted insert of the same key makes
    /// this wait for that transaction to end.
    fn insert_key<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a InboxStatements,
        consumer: &'a str,
        key: &'a [u8],
        fingerprint: Option<&'a [u8]>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Deletes the claim of `(consumer, key)` this transaction inserted: its message failed, and a
    /// redelivery must find the key free.
    fn forget_claim<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a InboxStatements,
        consumer: &'a str,
        key: &'a [u8],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Stores the body's serialized response on the claimed row, in the handler's transaction;
    /// whether the row it changed proved the transaction to be the one the inbox began (see
    /// [`Store::commit_proven`](super::Store::commit_proven)).
    fn set_response<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a InboxStatements,
        consumer: &'a str,
        key: &'a [u8],
        response: &'a [u8],
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// The committed row of `(consumer, key)`, if any.
    fn stored<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a InboxStatements,
        consumer: &'a str,
        key: &'a [u8],
    ) -> impl Future<Output = Result<Option<StoredRow>, sqlx::Error>> + Send + 'a;

    /// The inbox row of `(consumer, key)`.
    fn inspect<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a InboxStatements,
        consumer: &'a str,
        key: &'a [u8],
    ) -> impl Future<Output = Result<Option<InspectRow>, sqlx::Error>> + Send + 'a;

    /// A page of `consumer`'s rows processed in `[from, until)` (milliseconds), after the row
    /// `after` (its time and key), in order.
    fn list<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a InboxStatements,
        consumer: &'a str,
        range: (i64, i64),
        after: (i64, &'a [u8]),
        limit: i64,
    ) -> impl Future<Output = Result<Vec<ListRow>, sqlx::Error>> + Send + 'a;

    /// Deletes the inbox row of `(consumer, key)`; whether there was one.
    fn forget<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a InboxStatements,
        consumer: &'a str,
        key: &'a [u8],
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    /// Stores `response` on the inbox row of `(consumer, key)` if it has none, or has `tried`, in
    /// the open transaction; `true` when it did.
    fn fill_response<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a InboxStatements,
        consumer: &'a str,
        key: &'a [u8],
        response: &'a [u8],
        tried: &'a [u8],
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;
}

impl<DB> InboxQueries for DB
where
    DB: Database + HasStatementCache,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> &'q [u8]: Encode<'q, DB> + Type<DB>,
    for<'q> Option<&'q [u8]>: Encode<'q, DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'r> StoredRow: sqlx::FromRow<'r, DB::Row>,
    for<'r> InspectRow: sqlx::FromRow<'r, DB::Row>,
    for<'r> ListRow: sqlx::FromRow<'r, DB::Row>,
    DB::QueryResult: RowsAffected,
{
    async fn insert_key(
        conn: &mut DB::Connection,
        statements: &InboxStatements,
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
        statements: &InboxStatements,
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
        statements: &InboxStatements,
        consumer: &str,
        key: &[u8],
        response: &[u8],
    ) -> Result<bool, sqlx::Error> {
        let done = statements
            .query(AssertSqlSafe(statements.set_response.clone()))
            .bind(response)
            .bind(consumer)
            .bind(key)
            .execute(conn)
            .await?;
        Ok(statements.proves_transaction && done.rows() == 1)
    }

    async fn stored(
        conn: &mut DB::Connection,
        statements: &InboxStatements,
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

    async fn inspect(
        conn: &mut DB::Connection,
        statements: &InboxStatements,
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
        statements: &InboxStatements,
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

    async fn forget(
        conn: &mut DB::Connection,
        statements: &InboxStatements,
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

    async fn fill_response(
        conn: &mut DB::Connection,
        statements: &InboxStatements,
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
}
