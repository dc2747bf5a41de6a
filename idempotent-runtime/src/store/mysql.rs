//! The inbox on MySQL and MariaDB (InnoDB).
//!
//! The claim is `INSERT IGNORE` on the primary key, as the first statement of the handler's
//! transaction; `rows_affected() == 1` means this call inserted the row. (sqlx sets
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
//! -- and `idempotent_inbox_calls` as on PostgreSQL, with binary names and LONGBLOB results
//! ```
//!
//! Only one instance purges a table at a time: the purger holds a `GET_LOCK` named after the
//! database and the table while it runs.
//!
//! Both columns of the key are binary, so they compare byte by byte: no collation folds case or
//! trailing spaces. Stored keys are at most 64 bytes (see [`key`](crate::key)), consumer names at
//! most 200, so `INSERT IGNORE` never truncates one.

use sqlx::mysql::MySqlConnection;
use sqlx::{MySql, MySqlPool};

use super::{
    Backend, Dialect, HandlerConnection, PurgeLock, Sealed, Statements, end_purge_session, run_all,
    shared_queries,
};
use crate::table::TableName;

impl Sealed for MySql {}

impl HandlerConnection for MySqlConnection {
    type Backend = MySql;
}

/// The purger's lock name, given the table name: named after the database and the table, hashed
/// to fit MySQL's 64 characters.
#[doc(hidden)]
pub const PURGE_LOCK_NAME: &str =
    "CONCAT('idempotent_purge_', LEFT(SHA1(CONCAT(DATABASE(), '.', ?)), 40))";

impl Backend for MySql {
    const DIALECT: Dialect = Dialect {
        begin: "BEGIN",
        quote: '`',
        question_marks: true,
        insert_ignore: "INSERT IGNORE INTO",
        on_conflict: "",
        processed_now: "UTC_TIMESTAMP(6)",
        now_ms: "CAST(UNIX_TIMESTAMP(NOW(6)) * 1000 AS SIGNED)",
        older_than: "processed_at < UTC_TIMESTAMP(6) - INTERVAL ({} * 1000) MICROSECOND",
        delete_limit: true,
    };

    async fn migrate(pool: &MySqlPool, table: &TableName) -> Result<(), sqlx::Error> {
        let t = table.quoted('`');
        let index = table.quoted_suffixed("processed_at", '`');
        let calls = table.quoted_suffixed("calls", '`');
        let mut connection = pool.acquire().await?;
        run_all!(
            connection,
            [
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
        );
        Ok(())
    }

    async fn claim_batch(
        conn: &mut MySqlConnection,
        statements: &Statements,
        consumer: &str,
        keys: &[&[u8]],
    ) -> Result<Vec<Vec<u8>>, sqlx::Error> {
        // MySQL has no INSERT … RETURNING: one claim per key, in key order, in the transaction.
        let mut inserted = Vec::new();
        for key in keys {
            if Self::claim(conn, statements, consumer, key, None).await? {
                inserted.push(key.to_vec());
            }
        }
        Ok(inserted)
    }

    async fn try_lock_purge(
        pool: &MySqlPool,
        table: &TableName,
    ) -> Result<Option<PurgeLock<MySql>>, sqlx::Error> {
        let mut connection = pool.acquire().await?;
        let locked: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT GET_LOCK({PURGE_LOCK_NAME}, 0)"
        )))
        .bind(table.as_str())
        .fetch_one(&mut *connection)
        .await?;
        Ok((locked == Some(1)).then_some(PurgeLock {
            connection: Some(connection),
        }))
    }

    async fn unlock_purge(lock: PurgeLock<MySql>, table: &TableName) -> Result<(), sqlx::Error> {
        if let Some(mut connection) = lock.connection {
            let unlocked = sqlx::query(sqlx::AssertSqlSafe(format!(
                "SELECT RELEASE_LOCK({PURGE_LOCK_NAME})"
            )))
            .bind(table.as_str())
            .execute(&mut *connection)
            .await;
            return end_purge_session(connection, unlocked).await;
        }
        Ok(())
    }

    shared_queries!(MySqlPool, MySqlConnection);
}

/// MySQL and MariaDB error numbers worth a retry: deadlock (1213), lock wait timeout (1205), too
/// many connections (1040), server shutting down (1053), connection killed (1927, MariaDB), query
/// interrupted (1317), and the client's lost-connection errors (2006, 2013).
pub(crate) fn is_retryable_number(number: u16) -> bool {
    matches!(
        number,
        1213 | 1205 | 1040 | 1053 | 1927 | 1317 | 2006 | 2013
    )
}

#[cfg(test)]
mod tests {
    use super::is_retryable_number;

    #[test]
    fn deadlocks_and_lock_timeouts_are_retryable() {
        for number in [1213, 1205, 2013] {
            assert!(is_retryable_number(number), "{number}");
        }
        // duplicate entry, no such table, syntax error
        for number in [1062, 1146, 1064] {
            assert!(!is_retryable_number(number), "{number}");
        }
    }
}
