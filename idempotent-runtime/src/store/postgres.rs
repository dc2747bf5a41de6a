//! The inbox on PostgreSQL.
//!
//! The claim is an `INSERT` on the primary key, sent in one message with the `BEGIN` of the
//! handler's `READ COMMITTED` transaction, `BEGIN; EXECUTE idempotent_claim_…(…)`, so it costs no
//! round trip of its own; the `INSERT` is a statement each session prepares once (with `PREPARE`,
//! the first time a claim finds it missing), so it is not planned again for every message. When
//! another transaction has inserted the same key and not yet ended, the insert waits for it on the
//! index entry: after that transaction rolls back the insert goes ahead (ours to process), after it
//! commits the insert fails with a unique violation, which is how the server reports a duplicate;
//! the inbox then rolls back and returns `Duplicate`. There is no read before the write. The values
//! travel as hex digits that the statement decodes (`decode('…', 'hex')`), so no byte of a key or a
//! consumer name is ever spliced into SQL.
//!
//! The server writes each such unique violation to its log (at `ERROR`, with the statement), and
//! leaves a dead row version for `VACUUM`; a new session logs one `prepared statement does not
//! exist` before it prepares the claim. Where that is unwelcome, or where a pooler in transaction
//! mode (PgBouncer) does not keep a session's prepared statements,
//! [`Inbox::with_separate_claim`](crate::Inbox::with_separate_claim) claims with
//! `INSERT … ON CONFLICT DO NOTHING` in a statement of its own instead: no error for a duplicate,
//! one round trip more per message.
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

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgTransactionManager};
use sqlx::{AssertSqlSafe, Executor, PgPool, Postgres, SqlSafeStr};
use sqlx_core::transaction::TransactionManager;

use super::{
    Backend, Dialect, HandlerConnection, PurgeLock, Sealed, Statements, begin_then_claim,
    end_purge_session, run_all, shared_queries,
};
use sha2::{Digest, Sha256};

use crate::key::hex;
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

impl crate::Inbox<Postgres> {
    /// The same inbox, claiming with `INSERT … ON CONFLICT DO NOTHING` in a statement of its own
    /// after `BEGIN`, rather than in one message with it: a duplicate is then no error on the
    /// server (nothing in its log, no dead row version), at the cost of one round trip more per
    /// message. Both wait for a concurrent claim of the same key in the same way.
    pub fn with_separate_claim(self) -> Self {
        let statements = Statements {
            separate_claim: true,
            ..(*self.statements).clone()
        };
        Self {
            statements: std::sync::Arc::new(statements),
            ..self
        }
    }
}

impl Backend for Postgres {
    const DIALECT: Dialect = Dialect {
        begin: "BEGIN",
        quote: '"',
        question_marks: false,
        insert_ignore: "INSERT INTO",
        on_conflict: " ON CONFLICT DO NOTHING",
        processed_now: "now()",
        now_ms: "(extract(epoch FROM clock_timestamp()) * 1000)::bigint",
        older_than: "processed_at < now() - {} * interval '1 millisecond'",
        delete_limit: false,
    };

    async fn begin_claim(
        conn: &mut PoolConnection<Postgres>,
        statements: &Statements,
        consumer: &str,
        key: &[u8],
        fingerprint: Option<&[u8]>,
    ) -> Result<bool, sqlx::Error> {
        if statements.separate_claim {
            return begin_then_claim(conn, statements, consumer, key, fingerprint).await;
        }
        let claim = statements
            .prepared_claim
            .get_or_init(|| PreparedClaim::new(statements));
        let begin = claim.begin(consumer, key, fingerprint);
        match begin_with(conn, &begin).await {
            Err(error) if is_missing_statement(&error) => {}
            outcome => return outcome,
        }
        // This session has not prepared the claim: a new connection, or a `DEALLOCATE`.
        conn.execute(AssertSqlSafe(claim.prepare.clone())).await?;
        match begin_with(conn, &begin).await {
            // Still missing: a pooler in transaction mode moved us to another session.
            Err(error) if is_missing_statement(&error) => {
                begin_then_claim(conn, statements, consumer, key, fingerprint).await
            }
            outcome => outcome,
        }
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

/// The claim as a statement a session prepares: `PREPARE idempotent_claim_…` and its name, the
/// same for every session using one table (the name has a digest of the table's).
#[derive(Debug, Clone)]
pub(crate) struct PreparedClaim {
    name: String,
    prepare: String,
}

impl PreparedClaim {
    fn new(statements: &Statements) -> Self {
        let insert = statements
            .table_sql("INSERT INTO {t} (consumer, message_key, fingerprint) VALUES ($1, $2, $3)");
        let name = format!("idempotent_claim_{}", &hex(&Sha256::digest(&insert))[..16]);
        let prepare = format!("PREPARE {name} (text, bytea, bytea) AS {insert}");
        Self { name, prepare }
    }

    /// `BEGIN; EXECUTE …` claiming `(consumer, key, fingerprint)`, every value as hex digits.
    fn begin(&self, consumer: &str, key: &[u8], fingerprint: Option<&[u8]>) -> String {
        let fingerprint = fingerprint.map_or_else(
            || "NULL".to_owned(),
            |fingerprint| format!("decode('{}', 'hex')", hex(fingerprint)),
        );
        format!(
            "BEGIN; EXECUTE {}(convert_from(decode('{}', 'hex'), 'UTF8'), decode('{}', 'hex'), {fingerprint})",
            self.name,
            hex(consumer.as_bytes()),
            hex(key),
        )
    }
}

/// Sends `begin`, which begins the transaction and claims: `true` when the claim inserted the key
/// (the transaction is open, at depth one), `false` when the key was there (rolled back).
async fn begin_with(conn: &mut PoolConnection<Postgres>, begin: &str) -> Result<bool, sqlx::Error> {
    let statement = AssertSqlSafe(begin.to_owned()).into_sql_str();
    let Err(error) = PgTransactionManager::begin(conn, Some(statement)).await else {
        return Ok(true);
    };
    // The claim failed in the transaction its message began, which is now aborted (or the `BEGIN`
    // failed and there is none): end it before the connection is used again, or close it.
    if conn.execute("ROLLBACK").await.is_err() {
        conn.close_on_drop();
    }
    // A unique violation says another transaction committed the key, whatever became of ours.
    match error.as_database_error() {
        Some(database) if database.is_unique_violation() => Ok(false),
        _ => Err(error),
    }
}

/// Whether the server found no prepared statement of the name executed (SQLSTATE 26000).
fn is_missing_statement(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|error| error.code())
        .is_some_and(|code| code == "26000")
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
