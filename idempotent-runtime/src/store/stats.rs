//! What operators read of every table at once: rows, pending calls and horizons per consumer.

use std::future::Future;
use std::sync::Arc;

use sqlx::database::HasStatementCache;
use sqlx::{AssertSqlSafe, Database, Executor};

use super::dialect::Dialect;
use super::query::{QueryBuilder, in_own_transaction};
use crate::table::TableName;

/// What [`StatsQueries::stats`] reads: `(consumer, rows, oldest_ms)`, `(consumer, pending,
/// stuck)` calls and `(consumer, horizon_ms)`.
pub(crate) type StatsRows = (
    Vec<(String, i64, Option<i64>)>,
    Vec<(String, i64, i64)>,
    Vec<(String, i64)>,
);

/// The statements of the operators' summary, built once from the inbox's validated table name.
#[derive(Debug, Clone)]
pub struct StatsStatements {
    /// Rows and the oldest row per consumer.
    rows: Arc<str>,
    /// Pending and stuck calls per consumer.
    calls: Arc<str>,
    /// Every consumer's horizon.
    horizons: Arc<str>,
    /// Sent as behind a pooler in transaction mode: see [`Statements::pooled`].
    ///
    /// [`Statements::pooled`]: super::Statements::pooled
    pub(crate) pooled: bool,
}

impl QueryBuilder for StatsStatements {
    fn pooled(&self) -> bool {
        self.pooled
    }
}

impl StatsStatements {
    /// Builds the summary's statements on `table`'s tables in `dialect`.
    pub(crate) fn new(dialect: &Dialect, table: &TableName) -> Self {
        let q = dialect.quote;
        let (t, c, h) = (
            table.quoted(q),
            table.quoted_suffixed("calls", q),
            table.quoted_suffixed("horizons", q),
        );
        let consumer = dialect.text("consumer");
        let Dialect {
            processed_ms,
            now_ms,
            ..
        } = *dialect;
        Self {
            rows: format!(
                "SELECT {consumer}, COUNT(*), MIN({processed_ms}) FROM {t} GROUP BY consumer"
            )
            .into(),
            calls: format!(
                "SELECT {consumer}, COUNT(*), \
                 COUNT(CASE WHEN lease_until < {now_ms} THEN 1 END) \
                 FROM {c} WHERE completed = FALSE GROUP BY consumer"
            )
            .into(),
            horizons: format!("SELECT {consumer}, purged_until FROM {h}").into(),
            pooled: false,
        }
    }
}

/// The operators' summary, run; implemented once for every backend.
pub trait StatsQueries: Database {
    /// Per consumer: `(consumer, rows, oldest_ms)`, `(consumer, pending, stuck)` calls and
    /// `(consumer, horizon_ms)`.
    fn stats<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a StatsStatements,
    ) -> impl Future<Output = Result<StatsRows, sqlx::Error>> + Send + 'a;
}

impl<DB> StatsQueries for DB
where
    DB: Database + HasStatementCache,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'r> (String, i64, Option<i64>): sqlx::FromRow<'r, DB::Row>,
    for<'r> (String, i64, i64): sqlx::FromRow<'r, DB::Row>,
    for<'r> (String, i64): sqlx::FromRow<'r, DB::Row>,
{
    async fn stats(
        conn: &mut DB::Connection,
        statements: &StatsStatements,
    ) -> Result<StatsRows, sqlx::Error> {
        in_own_transaction!(conn, statements, async {
            let rows = statements
                .query_as(AssertSqlSafe(statements.rows.clone()))
                .fetch_all(&mut *conn)
                .await?;
            let calls = statements
                .query_as(AssertSqlSafe(statements.calls.clone()))
                .fetch_all(&mut *conn)
                .await?;
            let horizons = statements
                .query_as(AssertSqlSafe(statements.horizons.clone()))
                .fetch_all(&mut *conn)
                .await?;
            Ok((rows, calls, horizons))
        })
    }
}
