//! The inbox on MySQL and MariaDB (InnoDB).
//!
//! The handler's transaction begins with `SET autocommit = 0; START TRANSACTION; SAVEPOINT
//! idempotent_claim`, in one message. The claim is then `INSERT IGNORE` on the
//! primary key, as the first statement of the transaction; `rows_affected() == 1` means this call
//! inserted the row. (sqlx sets
//! `CLIENT_FOUND_ROWS`, which is why `ON DUPLICATE KEY UPDATE` cannot tell a claim from a
//! duplicate.) When another transaction has inserted the same key and not yet ended, InnoDB makes
//! the insert wait for a lock on that index record: after a commit the insert is ignored (0 rows: a
//! duplicate), after a rollback it goes ahead (1 row). When several waiters are released by one
//! rollback, InnoDB may pick one as a deadlock victim (error 1213); that error is
//! [retryable](crate::InboxError::is_retryable), like a lock wait timeout (1205).
//!
//! ```sql
//! CREATE TABLE `idempotent_inbox` (
//!     consumer     VARBINARY(200) NOT NULL,
//!     message_key  VARBINARY(255) NOT NULL,
//!     processed_at DATETIME(6)    NOT NULL,  -- UTC
//!     response     LONGBLOB,
//!     fingerprint  VARBINARY(64),
//!     PRIMARY KEY (consumer, message_key),
//!     INDEX `idempotent_inbox_processed_at` (processed_at)
//! ) ENGINE = InnoDB;
//! -- and `idempotent_inbox_calls`, `…_horizons`, `…_audit` and `…_schema` as on PostgreSQL,
//! -- with binary names and LONGBLOB results
//! ```
//!
//! Why autocommit is off around the transaction: InnoDB rolls back the *whole* transaction on a
//! deadlock (1213, and on Galera a brute-force abort or a certification conflict), and some
//! statements commit it implicitly (`BEGIN`, `CREATE TABLE`, `TRUNCATE`, …). A body that ignores
//! such an error, or runs such a statement, would otherwise go on writing in autocommit mode, each
//! write committed on its own, without the key. With autocommit off, those writes go into a new
//! transaction that only a `COMMIT` would commit. (A session made read-only would not do: MariaDB
//! keeps a rolled-back transaction's `READ WRITE` for the statements after it.) The savepoint
//! marks the transaction: the commit is `RELEASE SAVEPOINT idempotent_claim; COMMIT; SET
//! autocommit = 1` in one message, and the release fails when the transaction is not the one the
//! inbox began, so that what is open is rolled back and reported, never counted as processed. Every
//! end of the transaction turns autocommit back on.
//!
//! Only one instance purges a table at a time: the purger holds a `GET_LOCK` named after the
//! database and the table while it runs (closing its session if the purge is dropped half-way, as
//! `GET_LOCK` is held by the session and is re-entrant). On a Galera cluster the lock is a node's
//! own, not replicated: purgers on different nodes purge at once, and a batch that conflicts with
//! another node's fails retryably.
//!
//! On Galera, copies of a message claimed on two nodes do not wait for each other: both inserts
//! succeed, and the transaction that commits second is refused by the cluster (1213 at its commit,
//! or under its body when the winner's write-set aborts it first), retryably, with nothing of it
//! committed; its retry is a duplicate.
//!
//! Both columns of the key are binary, so they compare byte by byte: no collation folds case or
//! trailing spaces. Stored keys are at most 64 bytes (see [`key`](crate::key)), consumer names at
//! most 200, so `INSERT IGNORE` never truncates one.

use sqlx::mysql::{MySqlConnection, MySqlDatabaseError, MySqlTransactionManager};
use sqlx::{AssertSqlSafe, Executor, MySql};
use sqlx_core::transaction::TransactionManager;

use super::inbox::InboxStatements;
use super::{Backend, Dialect, Ending, HandlerConnection, Heads, OutboxDialect, RolledBack, Store};
use crate::error::Fault;
use crate::table::TableName;

/// The purger's lock name, given the table name: named after the database and the table, hashed
/// to fit MySQL's 64 characters.
const PURGE_LOCK_NAME: &str =
    "CONCAT('idempotent_purge_', LEFT(SHA1(CONCAT(DATABASE(), '.', ?)), 40))";

/// The migration's lock name, given the table name, as [`PURGE_LOCK_NAME`] is the purger's.
const MIGRATE_LOCK_NAME: &str =
    "CONCAT('idempotent_migrate_', LEFT(SHA1(CONCAT(DATABASE(), '.', ?)), 40))";

/// The inbox's `BEGIN`, with `$characteristics` (`SET TRANSACTION …; `, or nothing) for the
/// transaction it starts: one sequence for every transaction the inbox begins.
macro_rules! begin {
    ($characteristics:literal) => {
        concat!(
            "SET autocommit = 0; ",
            $characteristics,
            "START TRANSACTION; SAVEPOINT idempotent_claim"
        )
    };
}

/// Commits the transaction if it is still the one the inbox began, and sets the session back.
const COMMIT: &str = "RELEASE SAVEPOINT idempotent_claim; COMMIT; SET autocommit = 1";

/// Rolls back whatever is open, and sets the session back.
const ROLLBACK: &str = "ROLLBACK; SET autocommit = 1";

/// Rolls back what is open and sets the session back, once the savepoint shows that it is the
/// transaction the inbox began.
const CHECKED_ROLLBACK: &str = "RELEASE SAVEPOINT idempotent_claim; ROLLBACK; SET autocommit = 1";

/// `SAVEPOINT … does not exist`: the transaction is not the one that set it.
const ER_SP_DOES_NOT_EXIST: u16 = 1305;

impl HandlerConnection for MySqlConnection {
    type Backend = MySql;
}

impl Backend for MySql {}

impl Store for MySql {
    const DIALECT: Dialect = Dialect {
        quote: '`',
        question_marks: true,
        insert_ignore: "INSERT IGNORE INTO",
        on_conflict: "",
        processed_now: "UTC_TIMESTAMP(6)",
        now_ms: "CAST(UNIX_TIMESTAMP(NOW(6)) * 1000 AS SIGNED)",
        time_of_ms: "(TIMESTAMP'1970-01-01 00:00:00' + INTERVAL ({} * 1000) MICROSECOND)",
        processed_ms: "CAST(TIMESTAMPDIFF(MICROSECOND, TIMESTAMP'1970-01-01 00:00:00', processed_at) DIV 1000 AS SIGNED)",
        text_of: "CAST({} AS CHAR)",
        int: "SIGNED",
        upsert_horizon: " ON DUPLICATE KEY UPDATE purged_until = GREATEST(purged_until, VALUES(purged_until))",
        delete_limit: true,
        end_own_connection: Some("KILL CONNECTION_ID()"),
        own_transaction: None,
        vacuum: None,
        set_schema: None,
        outbox: OutboxDialect {
            skip_locked: " FOR UPDATE SKIP LOCKED",
            next_seq: " ON DUPLICATE KEY UPDATE last_seq = last_seq + 1, updated_at = VALUES(updated_at)",
            notify: None,
            mark_on_take: false,
            heads: Heads::GroupedByStateAndKey,
            runs_joined: false,
            pending_index_named: true,
        },
    };

    const REFUSES_LATER_WRITES: bool = true;

    const BEGIN: &'static str = begin!("");

    /// `READ COMMITTED` for this one transaction: at `REPEATABLE READ` the batch's `SELECT … FOR
    /// UPDATE SKIP LOCKED` leaves next-key locks on what it scanned (the table's end included),
    /// every insert of a writer waits for the batch, and the batch, waiting for a row such a writer
    /// inserted before, deadlocks with it.
    const BEGIN_RELAY: &'static str = begin!("SET TRANSACTION ISOLATION LEVEL READ COMMITTED; ");

    type Settings = ();
    type TransactionState = ();

    async fn ready_transaction(_conn: &mut MySqlConnection) -> Result<(), sqlx::Error> {
        Ok(())
    }

    async fn commit(conn: &mut MySqlConnection, _state: &()) -> Result<Ending, sqlx::Error> {
        let committed = conn.execute(COMMIT).await;
        let error = match committed {
            Ok(_) => {
                forget_transaction(conn);
                return Ok(Ending::Committed);
            }
            Err(error) => error,
        };
        match number(&error) {
            None => Err(error),
            Some(ER_SP_DOES_NOT_EXIST) => Ok(Ending::Replaced {
                later_writes_refused: end_replaced(conn).await?,
            }),
            // The server answered the `COMMIT` (a Galera certification conflict): it is not
            // committed.
            Some(_) => {
                end(conn).await?;
                Ok(Ending::Refused(error))
            }
        }
    }

    async fn rollback(conn: &mut MySqlConnection, _state: &()) -> Result<(), sqlx::Error> {
        end(conn).await
    }

    async fn rollback_checked(
        conn: &mut MySqlConnection,
        _state: &(),
    ) -> Result<RolledBack, sqlx::Error> {
        // The release fails when the transaction is not the one that set the savepoint (one a
        // statement of the body committed implicitly, or the server rolled back); then nothing
        // after it in the message runs.
        match conn.execute(CHECKED_ROLLBACK).await {
            Ok(_) => {
                forget_transaction(conn);
                Ok(RolledBack::Own)
            }
            Err(error) if number(&error) == Some(ER_SP_DOES_NOT_EXIST) => {
                Ok(RolledBack::Replaced {
                    later_writes_refused: end_replaced(conn).await?,
                })
            }
            Err(error) => Err(error),
        }
    }

    fn fault(error: &dyn sqlx::error::DatabaseError) -> Option<Fault> {
        let error = error.try_downcast_ref::<MySqlDatabaseError>()?;
        Some(fault_of_error(error.number(), error.code()))
    }

    fn base_ddl(table: &TableName) -> Vec<String> {
        let t = table.quoted('`');
        let index = table.index("processed_at", '`');
        let calls = table.quoted_suffixed("calls", '`');
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (
    consumer     VARBINARY(200) NOT NULL,
    message_key  VARBINARY(255) NOT NULL,
    processed_at DATETIME(6)    NOT NULL,
    response     LONGBLOB,
    fingerprint  VARBINARY(64),
    PRIMARY KEY (consumer, message_key),
    INDEX {index} (processed_at)
) ENGINE = InnoDB"
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {calls} (
    consumer    VARBINARY(200) NOT NULL,
    message_key VARBINARY(255) NOT NULL,
    call_name   VARBINARY(200) NOT NULL,
    fence       BIGINT         NOT NULL,
    lease_until BIGINT         NOT NULL,
    completed   BOOLEAN        NOT NULL,
    result      LONGBLOB,
    PRIMARY KEY (consumer, message_key, call_name)
) ENGINE = InnoDB"
            ),
        ]
    }

    fn upgrade_ddl(table: &TableName, to: u32) -> Vec<String> {
        let q = |suffix| table.quoted_suffixed(suffix, '`');
        let i = |suffix| table.index(suffix, '`');
        let (calls, horizons, audit, schema) = (q("calls"), q("horizons"), q("audit"), q("schema"));
        let now_ms = Self::DIALECT.now_ms;
        match to {
            // DDL commits implicitly here: each step can be run again (see `applied_before`).
            2 => vec![
                format!("ALTER TABLE {calls} ADD COLUMN updated_at BIGINT NOT NULL DEFAULT 0"),
                format!("UPDATE {calls} SET updated_at = {now_ms} WHERE updated_at = 0"),
                format!(
                    "CREATE INDEX {} ON {calls} (updated_at)",
                    i("calls_updated")
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {horizons} (
    consumer     VARBINARY(200) NOT NULL PRIMARY KEY,
    purged_until BIGINT         NOT NULL
) ENGINE = InnoDB"
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {audit} (
    id           BIGINT         NOT NULL AUTO_INCREMENT PRIMARY KEY,
    consumer     VARBINARY(200) NOT NULL,
    key_digest   VARCHAR(64)    NOT NULL,
    reason       TEXT           NOT NULL,
    processed_at BIGINT,
    forgotten_at BIGINT         NOT NULL,
    INDEX {} (forgotten_at)
) ENGINE = InnoDB",
                    i("audit_at")
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {schema} (
    version     INT    NOT NULL PRIMARY KEY,
    migrated_at BIGINT NOT NULL
) ENGINE = InnoDB"
                ),
            ],
            // Text compared byte by byte (`utf8mb4_bin`), read back as text.
            3 => vec![
                format!(
                    "CREATE TABLE IF NOT EXISTS {} (
    id           BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    message_id   VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    exchange     VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    routing_key  VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    payload      LONGBLOB     NOT NULL,
    headers      LONGBLOB,
    origin       VARCHAR(200) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    ordering_key VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    ordering_seq BIGINT,
    state        BIGINT       NOT NULL,
    attempts     BIGINT       NOT NULL,
    created_at   BIGINT       NOT NULL,
    due_at       BIGINT       NOT NULL,
    sent_at      BIGINT,
    last_error   TEXT CHARACTER SET utf8mb4,
    INDEX {} (state, ordering_key, ordering_seq, id),
    INDEX {} (state, sent_at)
) ENGINE = InnoDB",
                    q("outbox"),
                    i("outbox_pending"),
                    i("outbox_sent")
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {} (
    ordering_key VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL PRIMARY KEY,
    last_seq     BIGINT       NOT NULL,
    updated_at   BIGINT       NOT NULL,
    INDEX {} (updated_at)
) ENGINE = InnoDB",
                    q("outbox_keys"),
                    i("outbox_keys_at")
                ),
            ],
            // Version 4 purges skipped outgoing messages by `(state, sent_at)`, and version 5
            // reads the pending ones without a key by `(state, ordering_key, …)`, which version 3
            // indexes already: nothing to change but the version.
            4 | 5 => Vec::new(),
            _ => Vec::new(),
        }
    }

    fn applied_before(error: &sqlx::Error) -> bool {
        // Duplicate column name, duplicate key name: the step ran in a migration cut off later.
        number(error).is_some_and(|number| matches!(number, 1060 | 1061))
    }

    async fn lock_migration(
        conn: &mut MySqlConnection,
        table: &TableName,
    ) -> Result<(), sqlx::Error> {
        let locked: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT GET_LOCK({MIGRATE_LOCK_NAME}, 60)"
        )))
        .bind(table.as_str())
        .fetch_one(conn)
        .await?;
        if locked == Some(1) {
            Ok(())
        } else {
            Err(sqlx::Error::Protocol(
                "waited 60 s for another instance's migration of the same tables".into(),
            ))
        }
    }

    async fn unlock_migration(
        conn: &mut MySqlConnection,
        table: &TableName,
        _commit: bool,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(AssertSqlSafe(format!(
            "SELECT RELEASE_LOCK({MIGRATE_LOCK_NAME})"
        )))
        .bind(table.as_str())
        .execute(conn)
        .await?;
        Ok(())
    }

    async fn table_exists(
        conn: &mut MySqlConnection,
        _schema: Option<&str>,
        name: &str,
    ) -> Result<bool, sqlx::Error> {
        let found: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.TABLES \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?",
        )
        .bind(name)
        .fetch_one(conn)
        .await?;
        Ok(found > 0)
    }

    async fn claim_batch(
        conn: &mut MySqlConnection,
        statements: &InboxStatements,
        consumer: &str,
        keys: &[&[u8]],
    ) -> Result<Vec<Vec<u8>>, sqlx::Error> {
        use super::InboxQueries;
        // MySQL has no INSERT … RETURNING: one claim per key, in key order, in the transaction.
        let mut inserted = Vec::new();
        for key in keys {
            if Self::insert_key(conn, statements, consumer, key, None).await? {
                inserted.push(key.to_vec());
            }
        }
        Ok(inserted)
    }

    async fn try_lock_purge(
        conn: &mut MySqlConnection,
        table: &TableName,
        _pooled: bool,
    ) -> Result<bool, sqlx::Error> {
        let locked: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT GET_LOCK({PURGE_LOCK_NAME}, 0)"
        )))
        .bind(table.as_str())
        .fetch_one(conn)
        .await?;
        Ok(locked == Some(1))
    }

    async fn unlock_purge(
        conn: &mut MySqlConnection,
        table: &TableName,
        _pooled: bool,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(AssertSqlSafe(format!(
            "SELECT RELEASE_LOCK({PURGE_LOCK_NAME})"
        )))
        .bind(table.as_str())
        .execute(conn)
        .await?;
        Ok(())
    }
}

/// The MySQL error number of a database error.
fn number(error: &sqlx::Error) -> Option<u16> {
    let database = error.as_database_error()?;
    Some(database.try_downcast_ref::<MySqlDatabaseError>()?.number())
}

/// Ends a transaction that replaced the inbox's as [`end`] does, and says whether writes made
/// after the inbox's ended could not commit on their own: autocommit was still off (a body's
/// `SET autocommit = 1` commits what is open, and every write after it).
async fn end_replaced(conn: &mut MySqlConnection) -> Result<bool, sqlx::Error> {
    let autocommit: i64 = sqlx::query_scalar("SELECT @@autocommit")
        .fetch_one(&mut *conn)
        .await?;
    end(conn).await?;
    Ok(autocommit == 0)
}

/// Rolls back whatever is open and turns autocommit back on.
async fn end(conn: &mut MySqlConnection) -> Result<(), sqlx::Error> {
    conn.execute(ROLLBACK).await?;
    forget_transaction(conn);
    Ok(())
}

/// The transaction the inbox began has ended on the server, by a statement sent past sqlx's
/// transaction manager: let the manager stop counting it. It queues a `ROLLBACK`, which finds no
/// transaction (a no-op on MySQL) and goes out with the connection's next statement.
fn forget_transaction(conn: &mut MySqlConnection) {
    MySqlTransactionManager::start_rollback(conn);
}

/// What a MySQL or MariaDB error says about a retry: a deadlock (1213, also Galera's brute-force
/// aborts and certification conflicts), a lock wait timeout (1205), too many connections (1040), an
/// interrupted query (1317), a Galera node that is not (or no longer) part of its cluster's primary
/// component (1047, SQLSTATE 08S01), a commit that failed (1180: on Galera, a node that lost the
/// primary component as it committed, whose write-set never left it) and a serialization failure
/// (SQLSTATE 40001) are transient; a
/// server shutting down (1053), a killed connection (1927), a session closed for inactivity (4031),
/// the client's lost-connection errors (2006, 2013) and every connection exception (SQLSTATE class
/// 08 but 08S01) break the connection.
fn fault_of_error(number: u16, sqlstate: Option<&str>) -> Fault {
    match (number, sqlstate) {
        (1213 | 1205 | 1040 | 1317 | 1047 | 1180, _) | (_, Some("40001" | "08S01")) => {
            Fault::Transient
        }
        (1053 | 1927 | 4031 | 2006 | 2013, _) => Fault::Broken,
        (_, Some(state)) if state.starts_with("08") => Fault::Broken,
        _ => Fault::None,
    }
}

#[cfg(test)]
mod tests {
    use super::{Fault, fault_of_error};

    #[test]
    fn deadlocks_lock_timeouts_and_galera_conflicts_are_retryable() {
        for (number, state) in [
            (1213, "40001"),
            (1205, "HY000"),
            (1047, "08S01"),
            (1180, "HY000"),
        ] {
            assert_eq!(
                fault_of_error(number, Some(state)),
                Fault::Transient,
                "{number}"
            );
        }
        assert_eq!(fault_of_error(2013, Some("HY000")), Fault::Broken);
        assert_eq!(fault_of_error(1927, Some("70100")), Fault::Broken);
        // duplicate entry, no such table, syntax error, read-only transaction
        for (number, state) in [
            (1062, "23000"),
            (1146, "42S02"),
            (1064, "42000"),
            (1792, "25006"),
        ] {
            assert_eq!(fault_of_error(number, Some(state)), Fault::None, "{number}");
        }
    }
}
