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
//!     PRIMARY KEY (consumer, message_key),
//!     INDEX `idempotent_inbox_processed_at` (processed_at)
//! ) ENGINE = InnoDB;
//! ```
//!
//! Both columns of the key are binary, so they compare byte by byte: no collation folds case or
//! trailing spaces. Stored keys are at most 64 bytes (see [`key`](crate::key)), consumer names at
//! most 200, so `INSERT IGNORE` never truncates one.

use sqlx::mysql::MySqlConnection;
use sqlx::{AssertSqlSafe, MySql, MySqlPool, Transaction};

use super::{Backend, HandlerConnection, Sealed, Statements};
use crate::table::TableName;

impl Sealed for MySql {}

impl HandlerConnection for MySqlConnection {
    type Backend = MySql;
}

impl Backend for MySql {
    fn statements(table: &TableName) -> Statements {
        let t = table.quoted('`');
        Statements {
            claim: format!(
                "INSERT IGNORE INTO {t} (consumer, message_key, processed_at) VALUES (?, ?, UTC_TIMESTAMP(6))"
            )
            .into(),
            contains: format!("SELECT 1 FROM {t} WHERE consumer = ? AND message_key = ?").into(),
        }
    }

    async fn begin(pool: &MySqlPool) -> Result<Transaction<'static, MySql>, sqlx::Error> {
        pool.begin().await
    }

    async fn claim(
        conn: &mut MySqlConnection,
        statements: &Statements,
        consumer: &str,
        key: &[u8],
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(AssertSqlSafe(statements.claim.clone()))
            .bind(consumer)
            .bind(key)
            .execute(conn)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn contains(
        pool: &MySqlPool,
        statements: &Statements,
        consumer: &str,
        key: &[u8],
    ) -> Result<bool, sqlx::Error> {
        let row = sqlx::query(AssertSqlSafe(statements.contains.clone()))
            .bind(consumer)
            .bind(key)
            .fetch_optional(pool)
            .await?;
        Ok(row.is_some())
    }

    async fn migrate(pool: &MySqlPool, table: &TableName) -> Result<(), sqlx::Error> {
        let t = table.quoted('`');
        let index = table.quoted_index("processed_at", '`');
        sqlx::query(AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {t} (
                consumer     VARBINARY(200) NOT NULL,
                message_key  VARBINARY(255) NOT NULL,
                processed_at DATETIME(6)    NOT NULL,
                PRIMARY KEY (consumer, message_key),
                INDEX {index} (processed_at)
            ) ENGINE = InnoDB"
        )))
        .execute(pool)
        .await?;
        Ok(())
    }
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
