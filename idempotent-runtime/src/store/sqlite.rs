//! The inbox on SQLite, the embedded default.
//!
//! The handler's transaction starts with `BEGIN IMMEDIATE`, which takes the database's write lock
//! up front; the claim is then `INSERT OR IGNORE` on the primary key. A concurrent duplicate
//! therefore waits in `BEGIN IMMEDIATE` (for up to the connection's busy timeout, 5 s by default
//! in sqlx) until the first transaction ends, and then sees its row or its absence. Writers are
//! serialized, as SQLite always serializes them; WAL mode (see [`connect_options`]) lets readers
//! carry on meanwhile. An inbox (with its clones) queues its own transactions for the write lock
//! in the process, first come first served, instead of leaving them to poll the lock in SQLite's
//! busy handler, whose sleeps grow to 100 ms; a transaction that waits more than 5 seconds there
//! goes on to the database's lock (so that a handler that calls another on the same inbox fails
//! with a retryable busy error, as it would without the queue, rather than wait for ever).
//!
//! ```sql
//! CREATE TABLE "idempotent_inbox" (
//!     consumer     TEXT    NOT NULL,
//!     message_key  BLOB    NOT NULL,
//!     processed_at INTEGER NOT NULL,  -- Unix time in milliseconds
//!     response     BLOB,
//!     fingerprint  BLOB,
//!     PRIMARY KEY (consumer, message_key)
//! ) WITHOUT ROWID;
//! CREATE INDEX "idempotent_inbox_processed_at" ON "idempotent_inbox" (processed_at);
//! -- and "idempotent_inbox_calls" as on PostgreSQL, with INTEGER times
//! ```

use std::str::FromStr;

use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection, SqliteJournalMode};
use sqlx::{Sqlite, SqlitePool};

use super::{
    Backend, Dialect, HandlerConnection, PurgeLock, Sealed, Statements, run_all, shared_queries,
};
use crate::table::TableName;

impl Sealed for Sqlite {}

impl HandlerConnection for SqliteConnection {
    type Backend = Sqlite;
}

/// Connection options for an inbox database: the file is created if missing, and the journal is
/// in WAL mode so that readers do not wait for the serialized writers.
///
/// ```
/// # async fn demo() -> Result<(), sqlx::Error> {
/// let pool = sqlx::SqlitePool::connect_with(idempotent_runtime::sqlite::connect_options("sqlite://shop.db")?).await?;
/// # Ok(()) }
/// ```
pub fn connect_options(url: &str) -> Result<SqliteConnectOptions, sqlx::Error> {
    Ok(SqliteConnectOptions::from_str(url)?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal))
}

impl crate::Inbox<Sqlite> {
    /// An inbox in a private in-memory SQLite database, migrated, for the unit tests of your own
    /// handlers (those taking `&mut sqlx::SqliteConnection`): create your tables on
    /// [`pool()`](crate::Inbox::pool) and call the handlers with it. The database has one
    /// connection, so concurrent calls take turns (one that waits more than 5 seconds for it fails
    /// with a retryable pool timeout), and it is gone when the last clone is dropped.
    /// It behaves like the file-based inbox (the conformance suite runs on it), but it proves
    /// nothing about your production database.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let inbox = idempotent_runtime::Inbox::<sqlx::Sqlite>::in_memory().await?;
    /// sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY)").execute(inbox.pool()).await?;
    /// # Ok(()) }
    /// ```
    pub async fn in_memory() -> Result<Self, crate::InboxError> {
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .acquire_timeout(std::time::Duration::from_secs(5))
            .connect("sqlite::memory:")
            .await
            .map_err(crate::InboxError::database(crate::Stage::Migrate))?;
        let inbox = Self::new(pool);
        inbox.migrate().await?;
        Ok(inbox)
    }
}

impl Backend for Sqlite {
    const ONE_WRITER: bool = true;

    const DIALECT: Dialect = Dialect {
        begin: "BEGIN IMMEDIATE",
        quote: '"',
        question_marks: false,
        insert_ignore: "INSERT OR IGNORE INTO",
        on_conflict: "",
        processed_now: "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
        now_ms: "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
        older_than: "processed_at < CAST(unixepoch('subsec') * 1000 AS INTEGER) - {}",
        delete_limit: false,
    };

    async fn migrate(pool: &SqlitePool, table: &TableName) -> Result<(), sqlx::Error> {
        let t = table.quoted('"');
        let index = table.quoted_suffixed("processed_at", '"');
        let calls = table.quoted_suffixed("calls", '"');
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        run_all!(
            tx,
            [
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} (
                        consumer     TEXT    NOT NULL,
                        message_key  BLOB    NOT NULL,
                        processed_at INTEGER NOT NULL,
                        response     BLOB,
                        fingerprint  BLOB,
                        PRIMARY KEY (consumer, message_key)
                    ) WITHOUT ROWID"
                ),
                format!("CREATE INDEX IF NOT EXISTS {index} ON {t} (processed_at)"),
                format!(
                    "CREATE TABLE IF NOT EXISTS {calls} (
                        consumer    TEXT    NOT NULL,
                        message_key BLOB    NOT NULL,
                        call_name   TEXT    NOT NULL,
                        fence       INTEGER NOT NULL,
                        lease_until INTEGER NOT NULL,
                        completed   BOOLEAN NOT NULL,
                        result      BLOB,
                        PRIMARY KEY (consumer, message_key, call_name)
                    ) WITHOUT ROWID"
                ),
            ]
        );
        tx.commit().await
    }

    async fn claim_batch(
        conn: &mut SqliteConnection,
        statements: &Statements,
        consumer: &str,
        keys: &[&[u8]],
    ) -> Result<Vec<Vec<u8>>, sqlx::Error> {
        // SQLite binds at most 32766 parameters per statement.
        let mut inserted = Vec::new();
        for chunk in keys.chunks(10_000) {
            let values: Vec<String> = (0..chunk.len())
                .map(|i| {
                    format!(
                        "($1, ${}, CAST(unixepoch('subsec') * 1000 AS INTEGER))",
                        i + 2
                    )
                })
                .collect();
            let sql = statements.table_sql(&format!(
                "INSERT OR IGNORE INTO {{t}} (consumer, message_key, processed_at) VALUES {} \
                 RETURNING message_key",
                values.join(", ")
            ));
            let mut query = sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).bind(consumer);
            for key in chunk {
                query = query.bind(*key);
            }
            inserted.extend(query.fetch_all(&mut *conn).await?);
        }
        Ok(inserted)
    }

    async fn try_lock_purge(
        _pool: &SqlitePool,
        _table: &TableName,
    ) -> Result<Option<PurgeLock<Sqlite>>, sqlx::Error> {
        // SQLite serializes writers: two purgers only take turns, batch by batch.
        Ok(Some(PurgeLock { connection: None }))
    }

    async fn unlock_purge(_lock: PurgeLock<Sqlite>, _table: &TableName) -> Result<(), sqlx::Error> {
        Ok(())
    }

    shared_queries!(SqlitePool, SqliteConnection);
}

/// SQLite result codes worth a retry: `SQLITE_BUSY` and `SQLITE_LOCKED` with any extended code.
pub(crate) fn is_retryable_code(code: &str) -> bool {
    const SQLITE_BUSY: i32 = 5;
    const SQLITE_LOCKED: i32 = 6;
    code.parse::<i32>()
        .is_ok_and(|code| matches!(code & 0xFF, SQLITE_BUSY | SQLITE_LOCKED))
}

#[cfg(test)]
mod tests {
    use super::is_retryable_code;

    #[test]
    fn busy_and_locked_are_retryable_with_any_extended_code() {
        // SQLITE_BUSY, SQLITE_BUSY_SNAPSHOT (517), SQLITE_LOCKED, SQLITE_LOCKED_SHAREDCACHE (262)
        for code in ["5", "517", "6", "262"] {
            assert!(is_retryable_code(code), "{code}");
        }
        // SQLITE_CONSTRAINT_PRIMARYKEY (1555), SQLITE_READONLY (8), SQLITE_CORRUPT (11)
        for code in ["1555", "8", "11", "not a number"] {
            assert!(!is_retryable_code(code), "{code}");
        }
    }
}
