//! The store trait and one module per database.
//!
//! Every backend keeps one inbox table whose primary key is `(consumer, message_key)`, with the key
//! stored as bytes, the time it was processed, and room for a stored response and a payload
//! fingerprint; and a `<table>_calls` table for calls to outside services. What differs is the SQL
//! dialect ([`Dialect`]), how a transaction begins, the DDL, and how one instance takes the
//! purger's lock. The statements are built from the dialect in one place ([`Statements`]), and the
//! code that runs them is the same text for every backend (`shared_queries!`).

use std::future::Future;
use std::sync::Arc;

use sqlx::Pool;
use sqlx::pool::PoolConnection;
use sqlx_core::transaction::TransactionManager;

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

/// A row of the calls table: `(fence, lease_until, completed, result, now)`, times in milliseconds
/// of the database's clock.
pub(crate) type CallRow = (i64, i64, bool, Option<Vec<u8>>, i64);

/// What a duplicate's inbox row holds: `(response, fingerprint)`.
pub(crate) type StoredRow = (Option<Vec<u8>>, Option<Vec<u8>>);

/// A database the inbox can live in: implemented for [`sqlx::Postgres`], [`sqlx::Sqlite`] and
/// [`sqlx::MySql`] (with the `postgres`, `sqlite` and `mysql` features). Sealed: its methods are
/// the inbox's internals.
pub trait Backend: sqlx::Database + Sealed {
    #[doc(hidden)]
    /// How this database spells what the statements need.
    const DIALECT: Dialect;

    #[doc(hidden)]
    /// The database lets one transaction write at a time (SQLite): an inbox then queues its own
    /// writers in the process rather than have them poll the database's lock.
    const ONE_WRITER: bool = false;

    #[doc(hidden)]
    /// Begins a transaction on `conn` and claims `(consumer, key, fingerprint)` in it: `true`, with
    /// the transaction open at depth one, when this call inserted the key; `false`, with no
    /// transaction left open, when the key was there. A concurrent uncommitted claim of the same key
    /// makes this wait for that transaction to end. On an error no transaction is left open, or the
    /// connection is marked to close. Unless a backend does better: the backend's `BEGIN`, then
    /// [`claim`](Backend::claim).
    fn begin_claim<'a>(
        conn: &'a mut PoolConnection<Self>,
        statements: &'a Statements,
        consumer: &'a str,
        key: &'a [u8],
        fingerprint: Option<&'a [u8]>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a {
        begin_then_claim(conn, statements, consumer, key, fingerprint)
    }

    #[doc(hidden)]
    /// Creates the inbox and calls tables and their indexes if they are missing; safe to run
    /// concurrently.
    fn migrate<'a>(
        pool: &'a Pool<Self>,
        table: &'a TableName,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    #[doc(hidden)]
    /// Takes the purger's lock for `table` if no other instance holds it: `Some` with what holds
    /// it (release it with [`unlock_purge`](Backend::unlock_purge)), `None` if another has it.
    fn try_lock_purge<'a>(
        pool: &'a Pool<Self>,
        table: &'a TableName,
    ) -> impl Future<Output = Result<Option<PurgeLock<Self>>, sqlx::Error>> + Send + 'a;

    #[doc(hidden)]
    /// Releases the purger's lock.
    fn unlock_purge<'a>(
        lock: PurgeLock<Self>,
        table: &'a TableName,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    #[doc(hidden)]
    /// Inserts `(consumer, key, fingerprint)` unless the key is there, in the open transaction;
    /// `true` when this call inserted it. A concurrent uncommitted insert of the same key makes this
    /// wait for that transaction to end.
    fn claim<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        consumer: &'a str,
        key: &'a [u8],
        fingerprint: Option<&'a [u8]>,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    #[doc(hidden)]
    /// Claims every key of `keys` (sorted, without repeats) for `consumer` in one transaction, in
    /// key order so that two batches with overlapping keys wait for each other instead of
    /// deadlocking; returns the keys this call inserted.
    fn claim_batch<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        consumer: &'a str,
        keys: &'a [&'a [u8]],
    ) -> impl Future<Output = Result<Vec<Vec<u8>>, sqlx::Error>> + Send + 'a;

    #[doc(hidden)]
    /// Stores the body's serialized response on the claimed row, in the handler's transaction.
    fn set_response<'a>(
        conn: &'a mut Self::Connection,
        statements: &'a Statements,
        consumer: &'a str,
        key: &'a [u8],
        response: &'a [u8],
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    #[doc(hidden)]
    /// The committed row of `(consumer, key)`, if any.
    fn stored<'a>(
        pool: &'a Pool<Self>,
        statements: &'a Statements,
        consumer: &'a str,
        key: &'a [u8],
    ) -> impl Future<Output = Result<Option<StoredRow>, sqlx::Error>> + Send + 'a;

    #[doc(hidden)]
    /// Deletes one batch of expired rows with `statement` (see [`Statements::purge`]).
    fn purge_batch<'a>(
        pool: &'a Pool<Self>,
        statement: &'a str,
        retention_ms: i64,
        consumers: &'a [String],
        batch: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    #[doc(hidden)]
    /// Records a call as pending with fence 1 unless it is recorded; `true` when this inserted it.
    fn call_insert<'a>(
        pool: &'a Pool<Self>,
        statements: &'a Statements,
        id: CallId<'a>,
        lease_ms: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    #[doc(hidden)]
    /// The call's record.
    fn call_read<'a>(
        pool: &'a Pool<Self>,
        statements: &'a Statements,
        id: CallId<'a>,
    ) -> impl Future<Output = Result<Option<CallRow>, sqlx::Error>> + Send + 'a;

    #[doc(hidden)]
    /// Takes over a pending call whose lease expired and whose fence is still `fence`; `true` when
    /// this call did.
    fn call_take_over<'a>(
        pool: &'a Pool<Self>,
        statements: &'a Statements,
        id: CallId<'a>,
        fence: i64,
        lease_ms: i64,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;

    #[doc(hidden)]
    /// Marks the call completed with `result` if its fence is still `fence`; `true` when it did.
    fn call_complete<'a>(
        pool: &'a Pool<Self>,
        statements: &'a Statements,
        id: CallId<'a>,
        fence: i64,
        result: &'a [u8],
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;
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

/// [`Backend::begin_claim`] in two round trips: the backend's `BEGIN`, then [`Backend::claim`];
/// rolls back unless the key was claimed.
pub(crate) async fn begin_then_claim<DB: Backend>(
    conn: &mut PoolConnection<DB>,
    statements: &Statements,
    consumer: &str,
    key: &[u8],
    fingerprint: Option<&[u8]>,
) -> Result<bool, sqlx::Error> {
    crate::transaction::begin::<DB>(conn).await?;
    let claimed = DB::claim(conn, statements, consumer, key, fingerprint).await;
    if !matches!(claimed, Ok(true)) {
        let rolled_back = <DB as sqlx::Database>::TransactionManager::rollback(conn).await;
        if let Err(error) = rolled_back {
            // The connection is broken; the server ends the transaction with the session.
            conn.close_on_drop();
            return claimed.and(Err(error));
        }
    }
    claimed
}

/// What holds the purger's lock: a connection with a session lock (PostgreSQL, MySQL), or nothing
/// (SQLite serializes its writers anyway).
#[doc(hidden)]
pub struct PurgeLock<DB: sqlx::Database> {
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) connection: Option<PoolConnection<DB>>,
}

/// Ends the purger's session after its unlock statement: when the unlock failed, closes the
/// session, which releases its locks too.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) async fn end_purge_session<DB: sqlx::Database, T>(
    connection: PoolConnection<DB>,
    unlocked: Result<T, sqlx::Error>,
) -> Result<(), sqlx::Error> {
    if unlocked.is_err() {
        connection.close().await?;
    }
    unlocked.map(drop)
}

/// Identifies one call to an outside service: the message's consumer and key, and the call's name.
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
pub struct CallId<'a> {
    pub(crate) consumer: &'a str,
    pub(crate) key: &'a [u8],
    pub(crate) name: &'a str,
}

/// How a database spells what the inbox's statements need.
#[doc(hidden)]
#[derive(Debug, Clone, Copy)]
pub struct Dialect {
    /// Begins a transaction that will write.
    pub(crate) begin: &'static str,
    /// Quotes identifiers.
    pub(crate) quote: char,
    /// Placeholders are `?` (MySQL) rather than `$1`, `$2`, ….
    pub(crate) question_marks: bool,
    /// How "insert unless the primary key exists" begins, and what ends it.
    pub(crate) insert_ignore: &'static str,
    pub(crate) on_conflict: &'static str,
    /// The value of `processed_at` for a new row.
    pub(crate) processed_now: &'static str,
    /// The database's clock, in milliseconds since the Unix epoch.
    pub(crate) now_ms: &'static str,
    /// `processed_at` more than the bound number of milliseconds ago; `{}` is the placeholder.
    pub(crate) older_than: &'static str,
    /// `DELETE … ORDER BY … LIMIT` is allowed (MySQL), rather than a subquery on the key.
    pub(crate) delete_limit: bool,
}

/// The SQL an inbox runs, built once from its validated table name.
#[doc(hidden)]
#[derive(Debug, Clone)]
pub struct Statements {
    dialect: Dialect,
    table: String,
    /// Claim in a statement of its own after `BEGIN` (PostgreSQL claims with its `BEGIN` unless
    /// this is set).
    pub(crate) separate_claim: bool,
    /// The claim PostgreSQL sessions prepare, made on first use.
    #[cfg(feature = "postgres")]
    pub(crate) prepared_claim: std::sync::OnceLock<postgres::PreparedClaim>,
    pub(crate) claim: Arc<str>,
    pub(crate) stored: Arc<str>,
    pub(crate) set_response: Arc<str>,
    pub(crate) call_insert: Arc<str>,
    pub(crate) call_read: Arc<str>,
    pub(crate) call_take_over: Arc<str>,
    pub(crate) call_complete: Arc<str>,
}

/// Numbers placeholders as the dialect wants them.
struct Params {
    question_marks: bool,
    next: usize,
}

impl Params {
    fn next(&mut self) -> String {
        self.next += 1;
        if self.question_marks {
            "?".to_owned()
        } else {
            format!("${}", self.next)
        }
    }
}

impl Statements {
    pub(crate) fn new(dialect: Dialect, table: &TableName) -> Self {
        let t = table.quoted(dialect.quote);
        let c = table.quoted_suffixed("calls", dialect.quote);
        let Dialect {
            insert_ignore,
            on_conflict,
            processed_now,
            now_ms,
            ..
        } = dialect;
        let p = || Params {
            question_marks: dialect.question_marks,
            next: 0,
        };
        let key =
            |p: &mut Params| format!("consumer = {} AND message_key = {}", p.next(), p.next());
        let call = |p: &mut Params| {
            format!(
                "consumer = {} AND message_key = {} AND call_name = {}",
                p.next(),
                p.next(),
                p.next()
            )
        };
        let claim = {
            let mut p = p();
            let (a, b, f) = (p.next(), p.next(), p.next());
            format!(
                "{insert_ignore} {t} (consumer, message_key, fingerprint, processed_at) \
                 VALUES ({a}, {b}, {f}, {processed_now}){on_conflict}"
            )
        };
        let stored = format!(
            "SELECT response, fingerprint FROM {t} WHERE {}",
            key(&mut p())
        );
        let set_response = {
            let mut p = p();
            let r = p.next();
            format!("UPDATE {t} SET response = {r} WHERE {}", key(&mut p))
        };
        let call_insert = {
            let mut p = p();
            let (a, b, n, l) = (p.next(), p.next(), p.next(), p.next());
            format!(
                "{insert_ignore} {c} (consumer, message_key, call_name, fence, lease_until, completed) \
                 VALUES ({a}, {b}, {n}, 1, {now_ms} + {l}, FALSE){on_conflict}"
            )
        };
        let call_read = format!(
            "SELECT fence, lease_until, completed, result, {now_ms} FROM {c} WHERE {}",
            call(&mut p())
        );
        let call_take_over = {
            let mut p = p();
            let l = p.next();
            let which = call(&mut p);
            let f = p.next();
            format!(
                "UPDATE {c} SET fence = fence + 1, lease_until = {now_ms} + {l} \
                 WHERE {which} AND fence = {f} AND completed = FALSE AND lease_until <= {now_ms}"
            )
        };
        let call_complete = {
            let mut p = p();
            let r = p.next();
            let which = call(&mut p);
            let f = p.next();
            format!(
                "UPDATE {c} SET completed = TRUE, result = {r} \
                 WHERE {which} AND fence = {f} AND completed = FALSE"
            )
        };
        Statements {
            dialect,
            table: t,
            separate_claim: false,
            #[cfg(feature = "postgres")]
            prepared_claim: std::sync::OnceLock::new(),
            claim: claim.into(),
            stored: stored.into(),
            set_response: set_response.into(),
            call_insert: call_insert.into(),
            call_read: call_read.into(),
            call_take_over: call_take_over.into(),
            call_complete: call_complete.into(),
        }
    }

    /// `template` with `{t}` replaced by the quoted table name.
    #[cfg(any(feature = "postgres", feature = "sqlite"))]
    pub(crate) fn table_sql(&self, template: &str) -> String {
        template.replace("{t}", &self.table)
    }

    /// Deletes up to a bound number of rows processed more than a bound number of milliseconds
    /// ago, oldest first, of the consumer (`Some(1)`) or of every consumer but `others` ones
    /// (`None`). Binds: retention in milliseconds, the consumer names, the batch size.
    pub(crate) fn purge(&self, consumer: bool, others: usize) -> String {
        let t = &self.table;
        let mut p = Params {
            question_marks: self.dialect.question_marks,
            next: 0,
        };
        let older = self.dialect.older_than.replace("{}", &p.next());
        let scope = if consumer {
            format!(" AND consumer = {}", p.next())
        } else if others > 0 {
            let names: Vec<String> = (0..others).map(|_| p.next()).collect();
            format!(" AND consumer NOT IN ({})", names.join(", "))
        } else {
            String::new()
        };
        let limit = p.next();
        if self.dialect.delete_limit {
            format!("DELETE FROM {t} WHERE {older}{scope} ORDER BY processed_at LIMIT {limit}")
        } else {
            format!(
                "DELETE FROM {t} WHERE (consumer, message_key) IN \
                 (SELECT consumer, message_key FROM {t} WHERE {older}{scope} \
                 ORDER BY processed_at LIMIT {limit})"
            )
        }
    }
}

/// The methods of [`Backend`] whose code is the same for every database, for the concrete types
/// of one: `$pool` the pool type, `$conn` the connection type.
macro_rules! shared_queries {
    ($pool:ty, $conn:ty) => {
        async fn claim(
            conn: &mut $conn,
            statements: &$crate::store::Statements,
            consumer: &str,
            key: &[u8],
            fingerprint: Option<&[u8]>,
        ) -> Result<bool, sqlx::Error> {
            let done = sqlx::query(sqlx::AssertSqlSafe(statements.claim.clone()))
                .bind(consumer)
                .bind(key)
                .bind(fingerprint)
                .execute(conn)
                .await?;
            Ok(done.rows_affected() == 1)
        }

        async fn set_response(
            conn: &mut $conn,
            statements: &$crate::store::Statements,
            consumer: &str,
            key: &[u8],
            response: &[u8],
        ) -> Result<(), sqlx::Error> {
            sqlx::query(sqlx::AssertSqlSafe(statements.set_response.clone()))
                .bind(response)
                .bind(consumer)
                .bind(key)
                .execute(conn)
                .await?;
            Ok(())
        }

        async fn stored(
            pool: &$pool,
            statements: &$crate::store::Statements,
            consumer: &str,
            key: &[u8],
        ) -> Result<Option<$crate::store::StoredRow>, sqlx::Error> {
            sqlx::query_as(sqlx::AssertSqlSafe(statements.stored.clone()))
                .bind(consumer)
                .bind(key)
                .fetch_optional(pool)
                .await
        }

        async fn purge_batch(
            pool: &$pool,
            statement: &str,
            retention_ms: i64,
            consumers: &[String],
            batch: i64,
        ) -> Result<u64, sqlx::Error> {
            let mut query =
                sqlx::query(sqlx::AssertSqlSafe(statement.to_owned())).bind(retention_ms);
            for consumer in consumers {
                query = query.bind(consumer.as_str());
            }
            Ok(query.bind(batch).execute(pool).await?.rows_affected())
        }

        async fn call_insert(
            pool: &$pool,
            statements: &$crate::store::Statements,
            id: $crate::store::CallId<'_>,
            lease_ms: i64,
        ) -> Result<bool, sqlx::Error> {
            let done = sqlx::query(sqlx::AssertSqlSafe(statements.call_insert.clone()))
                .bind(id.consumer)
                .bind(id.key)
                .bind(id.name)
                .bind(lease_ms)
                .execute(pool)
                .await?;
            Ok(done.rows_affected() == 1)
        }

        async fn call_read(
            pool: &$pool,
            statements: &$crate::store::Statements,
            id: $crate::store::CallId<'_>,
        ) -> Result<Option<$crate::store::CallRow>, sqlx::Error> {
            sqlx::query_as(sqlx::AssertSqlSafe(statements.call_read.clone()))
                .bind(id.consumer)
                .bind(id.key)
                .bind(id.name)
                .fetch_optional(pool)
                .await
        }

        async fn call_take_over(
            pool: &$pool,
            statements: &$crate::store::Statements,
            id: $crate::store::CallId<'_>,
            fence: i64,
            lease_ms: i64,
        ) -> Result<bool, sqlx::Error> {
            let done = sqlx::query(sqlx::AssertSqlSafe(statements.call_take_over.clone()))
                .bind(lease_ms)
                .bind(id.consumer)
                .bind(id.key)
                .bind(id.name)
                .bind(fence)
                .execute(pool)
                .await?;
            Ok(done.rows_affected() == 1)
        }

        async fn call_complete(
            pool: &$pool,
            statements: &$crate::store::Statements,
            id: $crate::store::CallId<'_>,
            fence: i64,
            result: &[u8],
        ) -> Result<bool, sqlx::Error> {
            let done = sqlx::query(sqlx::AssertSqlSafe(statements.call_complete.clone()))
                .bind(result)
                .bind(id.consumer)
                .bind(id.key)
                .bind(id.name)
                .bind(fence)
                .execute(pool)
                .await?;
            Ok(done.rows_affected() == 1)
        }
    };
}
pub(crate) use shared_queries;

/// Runs each DDL statement in order.
macro_rules! run_all {
    ($executor:expr, $statements:expr) => {{
        for statement in $statements {
            sqlx::query(sqlx::AssertSqlSafe(statement))
                .execute(&mut *$executor)
                .await?;
        }
    }};
}
pub(crate) use run_all;

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
