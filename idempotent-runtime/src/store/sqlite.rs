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
//! While the transaction is open, the connection's commit hook refuses every commit but the
//! inbox's own, and its rollback hook notes any rollback. So a body that runs `COMMIT` or
//! `ROLLBACK` itself, or whose transaction SQLite rolls back after an error (a full disk), cannot
//! commit anything without the key (its later writes, each of which would otherwise commit on its
//! own, fail with `SQLITE_CONSTRAINT_COMMITHOOK`), and the inbox reports the transaction as ended
//! rather than processed. The hooks are the connection's only ones: do not install your own on a
//! connection the inbox uses.
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
//! -- and "idempotent_inbox_calls", "…_horizons", "…_audit" and "…_schema" as on PostgreSQL,
//! -- with INTEGER times
//! ```

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteError, SqliteJournalMode,
    SqliteTransactionManager,
};
use sqlx::{AssertSqlSafe, Executor, SqlSafeStr, Sqlite};
use sqlx_core::transaction::TransactionManager;

use super::inbox::InboxStatements;
use super::{Backend, Dialect, Ending, HandlerConnection, Heads, OutboxDialect, RolledBack, Store};
use crate::error::Fault;
use crate::table::TableName;

impl HandlerConnection for SqliteConnection {
    type Backend = Sqlite;
}

/// Returns connection options for an inbox database: the file is created if missing, and the
/// journal is in WAL mode so that readers do not wait for the serialized writers.
///
/// ```
/// # use idempotent_runtime as idempotent;
/// # async fn demo() -> Result<(), sqlx::Error> {
/// let pool = sqlx::SqlitePool::connect_with(idempotent::sqlite::connect_options("sqlite://shop.db")?).await?;
/// # Ok(()) }
/// ```
pub fn connect_options(url: &str) -> Result<SqliteConnectOptions, sqlx::Error> {
    Ok(SqliteConnectOptions::from_str(url)?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal))
}

mod hooks {
    use super::*;

    /// What the connection's hooks know of the inbox's transaction.
    #[derive(Debug, Default)]
    pub struct Hooks {
        /// The inbox's transaction is open: refuse every commit but its own.
        pub open: AtomicBool,
        /// The inbox itself is committing.
        pub committing: AtomicBool,
        /// A rollback happened while the transaction was open.
        pub rolled_back: AtomicBool,
    }

    /// Watches one transaction of the inbox through the connection's hooks; stops when dropped.
    #[derive(Debug)]
    pub struct TransactionHooks(pub Arc<Hooks>);

    impl Drop for TransactionHooks {
        fn drop(&mut self) {
            self.0.open.store(false, Ordering::SeqCst);
        }
    }
}
use hooks::{Hooks, TransactionHooks};

impl Backend for Sqlite {}

impl Store for Sqlite {
    const ONE_WRITER: bool = true;
    const CANCEL_SAFE: bool = true;
    const PURGE_LOCK: bool = false;

    const DIALECT: Dialect = Dialect {
        quote: '"',
        question_marks: false,
        insert_ignore: "INSERT OR IGNORE INTO",
        on_conflict: "",
        processed_now: "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
        now_ms: "CAST(unixepoch('subsec') * 1000 AS INTEGER)",
        time_of_ms: "{}",
        processed_ms: "processed_at",
        text_of: "{}",
        int: "INTEGER",
        upsert_horizon: " ON CONFLICT (consumer) DO UPDATE \
            SET purged_until = MAX(purged_until, excluded.purged_until)",
        delete_limit: false,
        end_own_connection: None,
        own_transaction: None,
        vacuum: None,
        set_schema: None,
        outbox: OutboxDialect {
            skip_locked: "",
            next_seq: " ON CONFLICT (ordering_key) DO UPDATE \
                SET last_seq = last_seq + 1, updated_at = {now}",
            notify: None,
            mark_on_take: true,
            heads: Heads::SkipScanBySubqueries,
            runs_joined: true,
            pending_index_named: false,
        },
    };

    const REFUSES_LATER_WRITES: bool = true;

    const BEGIN: &'static str = "BEGIN IMMEDIATE";

    type Settings = ();
    type TransactionState = TransactionHooks;

    async fn ready_transaction(
        conn: &mut SqliteConnection,
    ) -> Result<TransactionHooks, sqlx::Error> {
        // The inbox's transaction begins at depth 0. A connection that comes with a count of a
        // transaction was dropped after a body ended the inbox's transaction itself: the rollback
        // queued at the drop found none to end, and sqlx counts one that is not there (its next
        // `BEGIN` would be refused as a savepoint's). Make the count true first.
        while SqliteTransactionManager::get_transaction_depth(conn) > 0 {
            resync(conn).await?;
        }
        let hooks = Arc::new(Hooks {
            open: AtomicBool::new(true),
            ..Hooks::default()
        });
        let mut handle = conn.lock_handle().await?;
        let on_commit = hooks.clone();
        handle.set_commit_hook(move || {
            !on_commit.open.load(Ordering::SeqCst) || on_commit.committing.load(Ordering::SeqCst)
        });
        let on_rollback = hooks.clone();
        handle.set_rollback_hook(move || {
            if on_rollback.open.load(Ordering::SeqCst) {
                on_rollback.rolled_back.store(true, Ordering::SeqCst);
            }
        });
        Ok(TransactionHooks(hooks))
    }

    async fn commit(
        conn: &mut SqliteConnection,
        hooked: &TransactionHooks,
    ) -> Result<Ending, sqlx::Error> {
        let hooks = &hooked.0;
        if hooks.rolled_back.load(Ordering::SeqCst) {
            resync(conn).await?;
            // The commit hook refuses every commit but the inbox's while the transaction is open.
            return Ok(Ending::Replaced {
                later_writes_refused: Self::REFUSES_LATER_WRITES,
            });
        }
        hooks.committing.store(true, Ordering::SeqCst);
        let committed = SqliteTransactionManager::commit(conn).await;
        hooks.committing.store(false, Ordering::SeqCst);
        match committed {
            Ok(()) => Ok(Ending::Committed),
            // A failed commit commits nothing; what is left open (if anything) is rolled back.
            Err(error) => {
                resync(conn).await?;
                Ok(Ending::Refused(error))
            }
        }
    }

    async fn rollback(
        conn: &mut SqliteConnection,
        hooked: &TransactionHooks,
    ) -> Result<(), sqlx::Error> {
        if hooked.0.rolled_back.load(Ordering::SeqCst) {
            return resync(conn).await;
        }
        SqliteTransactionManager::rollback(conn).await
    }

    async fn rollback_checked(
        conn: &mut SqliteConnection,
        hooked: &TransactionHooks,
    ) -> Result<RolledBack, sqlx::Error> {
        // The hooks saw the inbox's transaction end under the body (its commits are refused).
        let replaced = hooked.0.rolled_back.load(Ordering::SeqCst);
        Self::rollback(conn, hooked).await?;
        Ok(if replaced {
            RolledBack::Replaced {
                later_writes_refused: Self::REFUSES_LATER_WRITES,
            }
        } else {
            RolledBack::Own
        })
    }

    fn fault(error: &dyn sqlx::error::DatabaseError) -> Option<Fault> {
        error.try_downcast_ref::<SqliteError>()?;
        Some(
            error
                .code()
                .map_or(Fault::None, |code| fault_of_code(&code)),
        )
    }

    fn base_ddl(table: &TableName) -> Vec<String> {
        let t = table.quoted('"');
        let index = table.index("processed_at", '"');
        let calls = table.quoted_suffixed("calls", '"');
        vec![
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
    }

    fn upgrade_ddl(table: &TableName, to: u32) -> Vec<String> {
        let q = |suffix| table.quoted_suffixed(suffix, '"');
        let i = |suffix| table.index(suffix, '"');
        let (calls, horizons, audit, schema) = (q("calls"), q("horizons"), q("audit"), q("schema"));
        let now_ms = Self::DIALECT.now_ms;
        match to {
            // One transaction: `ADD COLUMN` has no `IF NOT EXISTS` here, and needs none.
            2 => vec![
                format!("ALTER TABLE {calls} ADD COLUMN updated_at INTEGER NOT NULL DEFAULT 0"),
                format!("UPDATE {calls} SET updated_at = {now_ms} WHERE updated_at = 0"),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {calls} (updated_at)",
                    i("calls_updated")
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {horizons} (
    consumer     TEXT    NOT NULL PRIMARY KEY,
    purged_until INTEGER NOT NULL
) WITHOUT ROWID"
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {audit} (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    consumer     TEXT    NOT NULL,
    key_digest   TEXT    NOT NULL,
    reason       TEXT    NOT NULL,
    processed_at INTEGER,
    forgotten_at INTEGER NOT NULL
)"
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {audit} (forgotten_at)",
                    i("audit_at")
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {schema} (
    version     INTEGER NOT NULL PRIMARY KEY,
    migrated_at INTEGER NOT NULL
)"
                ),
            ],
            3 => {
                let (outbox, keys) = (q("outbox"), q("outbox_keys"));
                vec![
                    format!(
                        "CREATE TABLE IF NOT EXISTS {outbox} (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id   TEXT    NOT NULL,
    exchange     TEXT    NOT NULL,
    routing_key  TEXT    NOT NULL,
    payload      BLOB    NOT NULL,
    headers      BLOB,
    origin       TEXT    NOT NULL,
    ordering_key TEXT,
    ordering_seq INTEGER,
    state        INTEGER NOT NULL,
    attempts     INTEGER NOT NULL,
    created_at   INTEGER NOT NULL,
    due_at       INTEGER NOT NULL,
    sent_at      INTEGER,
    last_error   TEXT
)"
                    ),
                    format!(
                        "CREATE INDEX IF NOT EXISTS {} ON {outbox} (id) WHERE state = 0",
                        i("outbox_pending")
                    ),
                    format!(
                        "CREATE INDEX IF NOT EXISTS {} ON {outbox} (ordering_key, ordering_seq) \
                         WHERE state <> 1 AND ordering_key IS NOT NULL",
                        i("outbox_key_seq")
                    ),
                    format!(
                        "CREATE INDEX IF NOT EXISTS {} ON {outbox} (sent_at) WHERE state = 1",
                        i("outbox_sent")
                    ),
                    format!(
                        "CREATE TABLE IF NOT EXISTS {keys} (
    ordering_key TEXT    NOT NULL PRIMARY KEY,
    last_seq     INTEGER NOT NULL,
    updated_at   INTEGER NOT NULL
) WITHOUT ROWID"
                    ),
                    format!(
                        "CREATE INDEX IF NOT EXISTS {} ON {keys} (updated_at)",
                        i("outbox_keys_at")
                    ),
                ]
            }
            // Skipped outgoing messages, purged by the time they were skipped.
            4 => vec![format!(
                "CREATE INDEX IF NOT EXISTS {} ON {} (sent_at) WHERE state = 3",
                i("outbox_skipped"),
                q("outbox")
            )],
            // The pending outgoing messages without an ordering key, which a relay looks for at
            // each batch: among the pending rows, past every keyed one of a backlog.
            5 => vec![format!(
                "CREATE INDEX IF NOT EXISTS {} ON {} (id) WHERE state = 0 AND ordering_key IS NULL",
                i("outbox_unkeyed"),
                q("outbox")
            )],
            _ => Vec::new(),
        }
    }

    async fn lock_migration(
        conn: &mut SqliteConnection,
        _table: &TableName,
    ) -> Result<(), sqlx::Error> {
        SqliteTransactionManager::begin(conn, Some("BEGIN IMMEDIATE".into_sql_str())).await
    }

    async fn unlock_migration(
        conn: &mut SqliteConnection,
        _table: &TableName,
        commit: bool,
    ) -> Result<(), sqlx::Error> {
        if commit {
            SqliteTransactionManager::commit(conn).await
        } else {
            SqliteTransactionManager::rollback(conn).await
        }
    }

    async fn table_exists(
        conn: &mut SqliteConnection,
        _schema: Option<&str>,
        name: &str,
    ) -> Result<bool, sqlx::Error> {
        let found: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = $1",
        )
        .bind(name)
        .fetch_one(conn)
        .await?;
        Ok(found > 0)
    }

    async fn claim_batch(
        conn: &mut SqliteConnection,
        statements: &InboxStatements,
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
            let mut query = sqlx::query_scalar(AssertSqlSafe(sql)).bind(consumer);
            for key in chunk {
                query = query.bind(*key);
            }
            inserted.extend(query.fetch_all(&mut *conn).await?);
        }
        Ok(inserted)
    }

    async fn try_lock_purge(
        _conn: &mut SqliteConnection,
        _table: &TableName,
        _pooled: bool,
    ) -> Result<bool, sqlx::Error> {
        // SQLite serializes writers: two purgers only take turns, batch by batch.
        Ok(true)
    }

    async fn unlock_purge(
        _conn: &mut SqliteConnection,
        _table: &TableName,
        _pooled: bool,
    ) -> Result<(), sqlx::Error> {
        Ok(())
    }
}

/// Makes sqlx's count of open transactions true again after SQLite ended the transaction behind
/// its back (a rollback after an error, or the body's own `COMMIT` or `ROLLBACK`): begins one if
/// none is open, so that the transaction manager's rollback, which ends it, finds one.
async fn resync(conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
    // Fails with "cannot start a transaction within a transaction" when one is open: that is fine.
    let _ = conn.execute("BEGIN").await;
    SqliteTransactionManager::rollback(conn).await
}

/// What an SQLite result code (with any extended code) says about a retry: `SQLITE_BUSY` and
/// `SQLITE_LOCKED` (another writer), `SQLITE_FULL` (a full disk) and `SQLITE_IOERR` are transient.
fn fault_of_code(code: &str) -> Fault {
    const SQLITE_BUSY: i32 = 5;
    const SQLITE_LOCKED: i32 = 6;
    const SQLITE_IOERR: i32 = 10;
    const SQLITE_FULL: i32 = 13;
    match code.parse::<i32>().map(|code| code & 0xFF) {
        Ok(SQLITE_BUSY | SQLITE_LOCKED | SQLITE_IOERR | SQLITE_FULL) => Fault::Transient,
        _ => Fault::None,
    }
}

#[cfg(test)]
mod tests {
    use super::{Fault, fault_of_code};

    #[test]
    fn busy_locked_and_full_are_retryable_with_any_extended_code() {
        // SQLITE_BUSY, SQLITE_BUSY_SNAPSHOT (517), SQLITE_LOCKED, SQLITE_LOCKED_SHAREDCACHE (262),
        // SQLITE_FULL, SQLITE_IOERR_WRITE (778)
        for code in ["5", "517", "6", "262", "13", "778"] {
            assert_eq!(fault_of_code(code), Fault::Transient, "{code}");
        }
        // SQLITE_CONSTRAINT_PRIMARYKEY (1555), SQLITE_READONLY (8), SQLITE_CORRUPT (11),
        // SQLITE_CONSTRAINT_COMMITHOOK (531)
        for code in ["1555", "8", "11", "531", "not a number"] {
            assert_eq!(fault_of_code(code), Fault::None, "{code}");
        }
    }
}
