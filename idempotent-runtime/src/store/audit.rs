//! The audit table (`<table>_audit`): the messages operators forgot on purpose, and why; and the
//! schema table (`<table>_schema`), the versions of the tables.

use std::future::Future;
use std::sync::Arc;

use sqlx::database::HasStatementCache;
use sqlx::{AssertSqlSafe, Database, Encode, Executor, Type};

use super::dialect::{Dialect, Params};
use super::query::{QueryBuilder, in_own_transaction};
use crate::table::TableName;

/// An audit row: a forgotten message.
#[derive(Debug, sqlx::FromRow)]
pub struct AuditRow {
    pub(crate) consumer: String,
    /// The digest of the forgotten key.
    pub(crate) key_digest: String,
    pub(crate) reason: String,
    /// When the forgotten row was processed, in milliseconds since the Unix epoch.
    #[sqlx(rename = "processed_at")]
    pub(crate) processed_ms: Option<i64>,
    /// When it was forgotten, in milliseconds since the Unix epoch.
    #[sqlx(rename = "forgotten_at")]
    pub(crate) forgotten_ms: i64,
}

/// The statements on the audit and schema tables, built once from the inbox's validated table
/// name.
#[derive(Debug, Clone)]
pub struct AuditStatements {
    dialect: Dialect,
    /// The quoted schema table.
    schema: String,
    /// Records a forgotten row in the audit table.
    insert: Arc<str>,
    /// A consumer's (or every consumer's) audit rows, newest first: [`AuditRow`]s.
    read: Arc<str>,
    /// The newest schema version recorded.
    schema_version: Arc<str>,
    /// Sent as behind a pooler in transaction mode: see [`Statements::pooled`].
    ///
    /// [`Statements::pooled`]: super::Statements::pooled
    pub(crate) pooled: bool,
}

impl QueryBuilder for AuditStatements {
    fn pooled(&self) -> bool {
        self.pooled
    }
}

impl AuditStatements {
    /// Builds the statements on `table`'s audit and schema tables in `dialect`.
    pub(crate) fn new(dialect: &Dialect, table: &TableName) -> Self {
        let a = table.quoted_suffixed("audit", dialect.quote);
        let v = table.quoted_suffixed("schema", dialect.quote);
        let now_ms = dialect.now_ms;
        let insert = {
            let mut p = Params::new(dialect);
            let (consumer, digest, reason, processed) = (p.next(), p.next(), p.next(), p.next());
            format!(
                "INSERT INTO {a} (consumer, key_digest, reason, processed_at, forgotten_at) \
                 VALUES ({consumer}, {digest}, {reason}, {processed}, {now_ms})"
            )
        };
        let read = {
            let mut p = Params::new(dialect);
            let (any, consumer, limit) = (p.next(), p.next(), p.next());
            format!(
                "SELECT {} AS consumer, key_digest, reason, processed_at, forgotten_at FROM {a} \
                 WHERE ({any} = 1 OR consumer = {consumer}) ORDER BY id DESC LIMIT {limit}",
                dialect.text("consumer")
            )
        };
        let schema_version = format!("SELECT CAST(MAX(version) AS {}) FROM {v}", dialect.int);
        Self {
            dialect: *dialect,
            schema: v,
            insert: insert.into(),
            read: read.into(),
            schema_version: schema_version.into(),
            pooled: false,
        }
    }

    /// Records `version` as the tables' schema version (no bound values: it is part of the DDL).
    pub(crate) fn record_version(&self, version: u32) -> String {
        let Dialect {
            insert_ignore,
            on_conflict,
            now_ms,
            ..
        } = self.dialect;
        format!(
            "{insert_ignore} {} (version, migrated_at) VALUES ({version}, {now_ms}){on_conflict}",
            self.schema
        )
    }
}

/// The statements on the audit and schema tables, run; implemented once for every backend.
pub trait AuditQueries: Database {
    /// Writes the audit row of a message an operator acted on (forgot, or put back from a
    /// dead-letter queue); `processed_ms`, when the inbox had processed it.
    fn audit_insert<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a AuditStatements,
        consumer: &'a str,
        digest: &'a str,
        reason: &'a str,
        processed_ms: Option<i64>,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// The newest audit rows, of `consumer` or of every consumer.
    fn audit_read<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a AuditStatements,
        consumer: Option<&'a str>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<AuditRow>, sqlx::Error>> + Send + 'a;

    /// The newest schema version recorded, if any.
    fn schema_version<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a AuditStatements,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send + 'a;
}

impl<DB> AuditQueries for DB
where
    DB: Database + HasStatementCache,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'q> Option<i64>: Encode<'q, DB>,
    for<'r> (Option<i64>,): sqlx::FromRow<'r, DB::Row>,
    for<'r> AuditRow: sqlx::FromRow<'r, DB::Row>,
{
    async fn audit_insert(
        conn: &mut DB::Connection,
        statements: &AuditStatements,
        consumer: &str,
        digest: &str,
        reason: &str,
        processed_ms: Option<i64>,
    ) -> Result<(), sqlx::Error> {
        statements
            .query(AssertSqlSafe(statements.insert.clone()))
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
        statements: &AuditStatements,
        consumer: Option<&str>,
        limit: i64,
    ) -> Result<Vec<AuditRow>, sqlx::Error> {
        in_own_transaction!(
            conn,
            statements,
            statements
                .query_as(AssertSqlSafe(statements.read.clone()))
                .bind(i64::from(consumer.is_none()))
                .bind(consumer.unwrap_or(""))
                .bind(limit)
                .fetch_all(&mut *conn)
        )
    }

    async fn schema_version(
        conn: &mut DB::Connection,
        statements: &AuditStatements,
    ) -> Result<Option<i64>, sqlx::Error> {
        statements
            .query_scalar(AssertSqlSafe(statements.schema_version.clone()))
            .fetch_one(conn)
            .await
    }
}
