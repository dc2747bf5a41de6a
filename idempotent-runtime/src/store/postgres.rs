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
//!     response     BYTEA,      -- the body's value, with store_response
//!     fingerprint  BYTEA,      -- SHA-256 of the fingerprinted fields
//!     PRIMARY KEY (consumer, message_key)
//! );
//! CREATE INDEX "idempotent_inbox_processed_at" ON "idempotent_inbox" (processed_at);
//! CREATE TABLE "idempotent_inbox_calls" (
//!     consumer     TEXT    NOT NULL,
//!     message_key  BYTEA   NOT NULL,
//!     call_name    TEXT    NOT NULL,
//!     fence        BIGINT  NOT NULL,
//!     lease_until  BIGINT  NOT NULL,  -- the database's clock, Unix milliseconds
//!     completed    BOOLEAN NOT NULL,
//!     result       BYTEA,
//!     PRIMARY KEY (consumer, message_key, call_name)
//! );
//! ```
//!
//! Only one instance purges a table at a time: the purger holds a session advisory lock on the
//! table's OID while it runs.

use sqlx::postgres::PgConnection;
use sqlx::{PgPool, Postgres, Transaction};

use super::{
    Backend, Dialect, HandlerConnection, PurgeLock, Sealed, Statements, end_purge_session, run_all,
    shared_queries,
};
use crate::table::TableName;

/// Serializes concurrent `migrate()` calls, whose `CREATE … IF NOT EXISTS` can otherwise race.
const MIGRATE_LOCK: i64 = 0x1de4_7e47_0001;

impl Sealed for Postgres {}

impl HandlerConnection for PgConnection {
    type Backend = Postgres;
}

/// The purger's advisory lock, given the quoted table name: the pair (a constant, the table's
/// OID), so that tables of the same name in different schemas purge independently.
#[doc(hidden)]
pub const PURGE_LOCK_KEY: &str = "1768453, coalesce(to_regclass($1)::oid::int, 0)";

impl Backend for Postgres {
    const DIALECT: Dialect = Dialect {
        quote: '"',
        question_marks: false,
        insert_ignore: "INSERT INTO",
        on_conflict: " ON CONFLICT DO NOTHING",
        processed_now: "now()",
        now_ms: "(extract(epoch FROM clock_timestamp()) * 1000)::bigint",
        older_than: "processed_at < now() - {} * interval '1 millisecond'",
        delete_limit: false,
    };

    async fn begin(pool: &PgPool) -> Result<Transaction<'static, Postgres>, sqlx::Error> {
        pool.begin().await
    }

    async fn migrate(pool: &PgPool, table: &TableName) -> Result<(), sqlx::Error> {
        let t = table.quoted('"');
        let index = table.quoted_suffixed("processed_at", '"');
        let calls = table.quoted_suffixed("calls", '"');
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(MIGRATE_LOCK)
            .execute(&mut *tx)
            .await?;
        run_all!(
            tx,
            [
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} (
                        consumer     TEXT        NOT NULL,
                        message_key  BYTEA       NOT NULL,
                        processed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
                        response     BYTEA,
                        fingerprint  BYTEA,
                        PRIMARY KEY (consumer, message_key)
                    )"
                ),
                format!("CREATE INDEX IF NOT EXISTS {index} ON {t} (processed_at)"),
                format!(
                    "CREATE TABLE IF NOT EXISTS {calls} (
                        consumer    TEXT    NOT NULL,
                        message_key BYTEA   NOT NULL,
                        call_name   TEXT    NOT NULL,
                        fence       BIGINT  NOT NULL,
                        lease_until BIGINT  NOT NULL,
                        completed   BOOLEAN NOT NULL,
                        result      BYTEA,
                        PRIMARY KEY (consumer, message_key, call_name)
                    )"
                ),
            ]
        );
        tx.commit().await
    }

    async fn claim_batch(
        conn: &mut PgConnection,
        statements: &Statements,
        consumer: &str,
        keys: &[&[u8]],
    ) -> Result<Vec<Vec<u8>>, sqlx::Error> {
        let keys: Vec<Vec<u8>> = keys.iter().map(|k| k.to_vec()).collect();
        sqlx::query_scalar(sqlx::AssertSqlSafe(statements.table_sql(
            "INSERT INTO {t} (consumer, message_key) \
             SELECT $1, k FROM unnest($2::bytea[]) AS u(k) ORDER BY k \
             ON CONFLICT DO NOTHING RETURNING message_key",
        )))
        .bind(consumer)
        .bind(keys)
        .fetch_all(conn)
        .await
    }

    async fn try_lock_purge(
        pool: &PgPool,
        table: &TableName,
    ) -> Result<Option<PurgeLock<Postgres>>, sqlx::Error> {
        let mut connection = pool.acquire().await?;
        let locked: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT pg_try_advisory_lock({PURGE_LOCK_KEY})"
        )))
        .bind(table.quoted('"'))
        .fetch_one(&mut *connection)
        .await?;
        Ok(locked.then_some(PurgeLock {
            connection: Some(connection),
        }))
    }

    async fn unlock_purge(lock: PurgeLock<Postgres>, table: &TableName) -> Result<(), sqlx::Error> {
        if let Some(mut connection) = lock.connection {
            let unlocked = sqlx::query(sqlx::AssertSqlSafe(format!(
                "SELECT pg_advisory_unlock({PURGE_LOCK_KEY})"
            )))
            .bind(table.quoted('"'))
            .execute(&mut *connection)
            .await;
            return end_purge_session(connection, unlocked).await;
        }
        Ok(())
    }

    shared_queries!(PgPool, PgConnection);
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
