//! The inbox on PostgreSQL.
//!
//! The claim is `INSERT … ON CONFLICT DO NOTHING` on the primary key, as the first statement of
//! the handler's `READ COMMITTED` transaction. When another transaction has inserted the same key
//! and not yet ended, the insert waits for it on the index entry: after that transaction commits
//! the insert does nothing (0 rows: a duplicate), after it rolls back the insert goes ahead
//! (1 row: ours to process). There is no unique-violation path and no read before the write.
//!
//! ```sql
//! CREATE TABLE "idempotent_inbox" (
//!     consumer     TEXT        NOT NULL,
//!     message_key  BYTEA       NOT NULL,
//!     processed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
//!     PRIMARY KEY (consumer, message_key)
//! );
//! CREATE INDEX "idempotent_inbox_processed_at" ON "idempotent_inbox" (processed_at);
//! ```

use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, PgPool, Postgres, Transaction};

use super::{Backend, HandlerConnection, Sealed, Statements};
use crate::table::TableName;

/// Serializes concurrent `migrate()` calls, whose `CREATE … IF NOT EXISTS` can otherwise race.
const MIGRATE_LOCK: i64 = 0x1de4_7e47_0001;

impl Sealed for Postgres {}

impl HandlerConnection for PgConnection {
    type Backend = Postgres;
}

impl Backend for Postgres {
    fn statements(table: &TableName) -> Statements {
        let t = table.quoted('"');
        Statements {
            claim: format!(
                "INSERT INTO {t} (consumer, message_key) VALUES ($1, $2) ON CONFLICT DO NOTHING"
            )
            .into(),
            contains: format!("SELECT 1 FROM {t} WHERE consumer = $1 AND message_key = $2").into(),
        }
    }

    async fn begin(pool: &PgPool) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
        pool.begin().await
    }

    async fn claim(
        conn: &mut PgConnection,
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
        pool: &PgPool,
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

    async fn migrate(pool: &PgPool, table: &TableName) -> Result<(), sqlx::Error> {
        let t = table.quoted('"');
        let index = table.quoted_index("processed_at", '"');
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(MIGRATE_LOCK)
            .execute(&mut *tx)
            .await?;
        sqlx::query(AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {t} (
                consumer     TEXT        NOT NULL,
                message_key  BYTEA       NOT NULL,
                processed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
                PRIMARY KEY (consumer, message_key)
            )"
        )))
        .execute(&mut *tx)
        .await?;
        sqlx::query(AssertSqlSafe(format!(
            "CREATE INDEX IF NOT EXISTS {index} ON {t} (processed_at)"
        )))
        .execute(&mut *tx)
        .await?;
        tx.commit().await
    }
}

/// SQLSTATEs worth a retry: serialization failure, deadlock, lock not available, the server
/// shutting down or starting up, too many connections, and every connection exception (class 08).
pub(crate) fn is_retryable_code(code: &str) -> bool {
    matches!(
        code,
        "40001" | "40P01" | "55P03" | "57P01" | "57P02" | "57P03" | "53300"
    ) || code.starts_with("08")
}

#[cfg(test)]
mod tests {
    use super::is_retryable_code;

    #[test]
    fn transient_sqlstates_are_retryable() {
        for code in [
            "40001", "40P01", "55P03", "57P01", "08006", "08003", "53300",
        ] {
            assert!(is_retryable_code(code), "{code}");
        }
        for code in ["23505", "42P01", "22P02", "42501"] {
            assert!(!is_retryable_code(code), "{code}");
        }
    }
}
