//! The purge: the horizons table (`<table>_horizons`, each consumer's purge horizon), the
//! statements of one pass over the inbox, calls and audit tables, and the purger's lock.

use std::future::Future;
use std::sync::Arc;

use sqlx::database::HasStatementCache;
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Database, Encode, Executor, Pool, Type};

use super::dialect::{Dialect, Params};
use super::driver::Store;
use super::query::{QueryBuilder, RowsAffected, in_own_transaction};
use crate::table::TableName;

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

/// What a purge statement binds, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bind {
    /// The cutoff, in milliseconds of the database's clock.
    Cutoff,
    /// The scope's consumer names (none, one, or every overridden one).
    Consumers,
    /// The batch size.
    Limit,
}

/// A statement of the purge and what it binds.
#[derive(Debug, Clone)]
pub struct PurgeSql {
    pub(crate) sql: String,
    pub(crate) binds: Vec<Bind>,
}

/// Whose rows one pass of the purge deletes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum PurgeScope {
    /// One consumer with a retention of its own.
    Consumer,
    /// Every consumer but this many overridden ones.
    AllBut(usize),
}

/// The statements of one pass of the purge: the horizon it records before it deletes, then the
/// batches of each table, and the counts of a dry run.
#[derive(Debug, Clone)]
pub(crate) struct PurgeStatements {
    /// The consumers with expired rows, whose horizons the pass moves up to the cutoff: a read,
    /// which takes no lock a claim would wait for.
    pub(crate) expiring: PurgeSql,
    /// Deletes a batch of expired inbox rows, oldest first.
    pub(crate) rows: PurgeSql,
    /// Deletes a batch of expired call records: completed, or pending with a lease that ran out,
    /// and untouched since the cutoff.
    pub(crate) calls: PurgeSql,
    /// Deletes a batch of expired audit rows.
    pub(crate) audit: PurgeSql,
    /// `(consumer, count)` of what `rows`, `calls` and `audit` would delete.
    pub(crate) count: [PurgeSql; 3],
}

/// The statements on the horizons table, and what builds each pass of the purge, built once from
/// the inbox's validated table name.
#[derive(Debug, Clone)]
pub struct HorizonStatements {
    dialect: Dialect,
    /// The quoted inbox, calls and audit tables.
    table: String,
    calls: String,
    audit: String,
    /// The database's clock, in milliseconds.
    now: Arc<str>,
    /// A consumer's purge horizon (milliseconds of the database's clock), if it has one.
    horizon: Arc<str>,
    /// Moves a consumer's horizon forward to a bound time, never back.
    record_horizon: Arc<str>,
    /// Sent as behind a pooler in transaction mode: see [`Statements::pooled`].
    ///
    /// [`Statements::pooled`]: super::Statements::pooled
    pub(crate) pooled: bool,
}

impl QueryBuilder for HorizonStatements {
    fn pooled(&self) -> bool {
        self.pooled
    }
}

impl HorizonStatements {
    /// Builds the statements on `table`'s horizons table in `dialect`.
    pub(crate) fn new(dialect: &Dialect, table: &TableName) -> Self {
        let q = dialect.quote;
        let h = table.quoted_suffixed("horizons", q);
        let horizon = format!(
            "SELECT purged_until FROM {h} WHERE consumer = {}",
            Params::new(dialect).next()
        );
        let record_horizon = {
            let mut p = Params::new(dialect);
            let (consumer, until) = (p.next(), p.next());
            format!(
                "INSERT INTO {h} (consumer, purged_until) VALUES ({consumer}, {until}){}",
                dialect.upsert_horizon.replace("{h}", &h)
            )
        };
        Self {
            dialect: *dialect,
            table: table.quoted(q),
            calls: table.quoted_suffixed("calls", q),
            audit: table.quoted_suffixed("audit", q),
            now: format!("SELECT {}", dialect.now_ms).into(),
            horizon: horizon.into(),
            record_horizon: record_horizon.into(),
            pooled: false,
        }
    }

    /// The statements of one pass of the purge over `scope`; see [`PurgeStatements`].
    pub(crate) fn purge(&self, scope: PurgeScope) -> PurgeStatements {
        let Dialect {
            time_of_ms,
            text_of,
            delete_limit,
            ..
        } = self.dialect;
        let (t, c, a) = (&self.table, &self.calls, &self.audit);
        let consumer_text = text_of.replace("{}", "consumer");
        // `WHERE` of the expired rows of a table, given the condition on the cutoff, and its binds.
        let expired = |condition: &str, cutoffs: usize, p: &mut Params| {
            let mut binds = vec![Bind::Cutoff; cutoffs];
            let mut sql = condition.to_owned();
            for _ in 0..cutoffs {
                sql = sql.replacen("{}", &p.next(), 1);
            }
            match scope {
                PurgeScope::Consumer => {
                    sql.push_str(&format!(" AND consumer = {}", p.next()));
                    binds.push(Bind::Consumers);
                }
                PurgeScope::AllBut(0) => {}
                PurgeScope::AllBut(others) => {
                    let names: Vec<String> = (0..others).map(|_| p.next()).collect();
                    sql.push_str(&format!(" AND consumer NOT IN ({})", names.join(", ")));
                    binds.push(Bind::Consumers);
                }
            }
            (sql, binds)
        };
        let rows_expired = format!("processed_at < {time_of_ms}");
        let calls_expired = "updated_at < {} AND (completed = TRUE OR lease_until < {})";
        let audit_expired = "forgotten_at < {}";
        // Deletes a batch, oldest first: by `ORDER BY … LIMIT` or through the primary key.
        let delete = |table: &str, condition: &str, cutoffs: usize, order: &str, key: &str| {
            let mut p = Params::new(&self.dialect);
            let (which, mut binds) = expired(condition, cutoffs, &mut p);
            let limit = p.next();
            binds.push(Bind::Limit);
            let sql = if delete_limit {
                format!("DELETE FROM {table} WHERE {which} ORDER BY {order} LIMIT {limit}")
            } else {
                format!(
                    "DELETE FROM {table} WHERE ({key}) IN \
                     (SELECT {key} FROM {table} WHERE {which} ORDER BY {order} LIMIT {limit})"
                )
            };
            PurgeSql { sql, binds }
        };
        let count = |table: &str, condition: &str, cutoffs: usize| {
            let mut p = Params::new(&self.dialect);
            let (which, binds) = expired(condition, cutoffs, &mut p);
            PurgeSql {
                sql: format!(
                    "SELECT {consumer_text}, COUNT(*) FROM {table} WHERE {which} GROUP BY consumer"
                ),
                binds,
            }
        };
        let expiring = {
            let mut p = Params::new(&self.dialect);
            let (which, binds) = expired(&rows_expired, 1, &mut p);
            PurgeSql {
                sql: format!("SELECT DISTINCT {consumer_text} FROM {t} WHERE {which}"),
                binds,
            }
        };
        PurgeStatements {
            expiring,
            rows: delete(t, &rows_expired, 1, "processed_at", "consumer, message_key"),
            calls: delete(
                c,
                calls_expired,
                2,
                "updated_at",
                "consumer, message_key, call_name",
            ),
            audit: delete(a, audit_expired, 1, "forgotten_at", "id"),
            count: [
                count(t, &rows_expired, 1),
                count(c, calls_expired, 2),
                count(a, audit_expired, 1),
            ],
        }
    }
}

/// The purge's statements, run; implemented once for every backend.
pub trait PurgeQueries: Database {
    /// The database's clock, in milliseconds since the Unix epoch.
    fn now_ms<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a HorizonStatements,
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + 'a;

    /// Runs a statement of the purge (see [`HorizonStatements::purge`]); the rows it changed.
    fn purge_step<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a HorizonStatements,
        sql: &'a PurgeSql,
        cutoff: i64,
        consumers: &'a [String],
        batch: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// The consumers a purge pass finds expired rows of (see [`HorizonStatements::purge`]).
    fn purge_consumers<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a HorizonStatements,
        sql: &'a PurgeSql,
        cutoff: i64,
        consumers: &'a [String],
    ) -> impl Future<Output = Result<Vec<String>, sqlx::Error>> + Send + 'a;

    /// Moves `consumer`'s horizon forward to `until`.
    fn record_horizon<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a HorizonStatements,
        consumer: &'a str,
        until: i64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Runs a count of the purge's dry run: `(consumer, rows)`.
    fn purge_count<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a HorizonStatements,
        sql: &'a PurgeSql,
        cutoff: i64,
        consumers: &'a [String],
    ) -> impl Future<Output = Result<Vec<(String, i64)>, sqlx::Error>> + Send + 'a;

    /// `consumer`'s purge horizon, in milliseconds of the database's clock.
    fn horizon<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a HorizonStatements,
        consumer: &'a str,
    ) -> impl Future<Output = Result<Option<i64>, sqlx::Error>> + Send + 'a;
}

impl<DB> PurgeQueries for DB
where
    DB: Database + HasStatementCache,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    <DB as Database>::Arguments: sqlx::IntoArguments<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'r> (i64,): sqlx::FromRow<'r, DB::Row>,
    for<'r> (String,): sqlx::FromRow<'r, DB::Row>,
    for<'r> (String, i64): sqlx::FromRow<'r, DB::Row>,
    DB::QueryResult: RowsAffected,
{
    async fn now_ms(
        conn: &mut DB::Connection,
        statements: &HorizonStatements,
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
        statements: &HorizonStatements,
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
        statements: &HorizonStatements,
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
        statements: &HorizonStatements,
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
        statements: &HorizonStatements,
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
        statements: &HorizonStatements,
        consumer: &str,
    ) -> Result<Option<i64>, sqlx::Error> {
        statements
            .query_scalar(AssertSqlSafe(statements.horizon.clone()))
            .bind(consumer)
            .fetch_optional(conn)
            .await
    }
}

/// A connection holding the purger's lock (a session's lock; behind a pooler in transaction mode,
/// the lock of a transaction left open on it): released by [`PurgeLock::unlock`], or, when dropped
/// without it (a cancelled purge, a purge that failed), closed, which releases the lock with the
/// session or the transaction.
pub(crate) struct PurgeLock<DB: Store> {
    connection: Option<PoolConnection<DB>>,
    pooled: bool,
}

impl<DB: Store> PurgeLock<DB> {
    /// Takes the purger's lock for `table` if no other instance holds it.
    pub(crate) async fn try_lock(
        pool: &Pool<DB>,
        table: &TableName,
        pooled: bool,
    ) -> Result<Option<Self>, sqlx::Error> {
        if !DB::PURGE_LOCK {
            return Ok(Some(Self {
                connection: None,
                pooled,
            }));
        }
        // Held by the lock from here on, so that a purge dropped while the lock statement runs
        // closes the session rather than let it go back to the pool with the lock taken.
        let mut lock = Self {
            connection: Some(pool.acquire().await?),
            pooled,
        };
        let connection = lock.connection.as_mut().expect("just set");
        if DB::try_lock_purge(connection, table, pooled).await? {
            return Ok(Some(lock));
        }
        // Not taken: nothing is held, and the connection goes back to the pool.
        lock.connection.take();
        Ok(None)
    }

    /// Releases the lock; when that fails, the session is closed, which releases it too.
    pub(crate) async fn unlock(mut self, table: &TableName) -> Result<(), sqlx::Error> {
        let Some(connection) = self.connection.as_mut() else {
            return Ok(());
        };
        DB::unlock_purge(connection, table, self.pooled).await?;
        self.connection.take();
        Ok(())
    }
}

impl<DB: Store> Drop for PurgeLock<DB> {
    fn drop(&mut self) {
        if let Some(connection) = &mut self.connection {
            connection.close_on_drop();
        }
    }
}
