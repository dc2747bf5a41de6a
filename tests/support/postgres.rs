//! A fresh schema per test in the PostgreSQL that `IDEMPOTENT_PG_URL` points to.

use std::time::Duration;

use idempotent::Inbox;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Postgres};

use super::{CREATE_EFFECTS, Consumer, Delivery, Harness, Outcome, Quote};

mod handlers {
    crate::support::effect_handlers!(
        sqlx::PgConnection,
        "INSERT INTO effects (consumer, label) VALUES ($1, $2)"
    );
}

/// The server the tests run against. `scripts/test` starts one; CI does too. Not set means not
/// tested, which must never pass silently.
pub fn url() -> String {
    std::env::var("IDEMPOTENT_PG_URL").expect(
        "IDEMPOTENT_PG_URL is not set: run the tests with scripts/test, which starts PostgreSQL",
    )
}

pub struct PgHarness {
    pub inbox: Inbox<Postgres>,
    pub impatient: Inbox<Postgres>,
    pub pool: PgPool,
    pub schema: String,
}

impl PgHarness {
    pub async fn new() -> Self {
        let options: PgConnectOptions = url().parse().expect("IDEMPOTENT_PG_URL");
        let schema = format!("t_{}", uuid::Uuid::new_v4().simple());
        let mut admin = options.connect().await.expect("connect to PostgreSQL");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&mut admin)
            .await
            .unwrap();
        let options = options
            .options([("search_path", schema.as_str())])
            .application_name(&schema);
        let pool = PgPoolOptions::new()
            .max_connections(40)
            .connect_with(options.clone())
            .await
            .expect("connect to PostgreSQL");
        let impatient = PgPoolOptions::new()
            .max_connections(2)
            .connect_lazy_with(options.options([("lock_timeout", "300ms")]));
        sqlx::query(CREATE_EFFECTS).execute(&pool).await.unwrap();
        for statement in super::CREATE_UNIQUES {
            sqlx::query(statement).execute(&pool).await.unwrap();
        }
        let inbox = Inbox::new(pool.clone());
        inbox.migrate().await.expect("migrate");
        Self {
            inbox,
            impatient: Inbox::new(impatient),
            pool,
            schema,
        }
    }
}

impl PgHarness {
    /// The same harness whose inboxes send the claim in one message with its `BEGIN`.
    pub fn with_pipelined_claim(self) -> Self {
        Self {
            inbox: self.inbox.with_pipelined_claim(),
            impatient: self.impatient.with_pipelined_claim(),
            ..self
        }
    }
}

impl Harness for PgHarness {
    crate::support::harness_methods!("$1", "$2");

    type Db = Postgres;

    fn inbox_with_pool(&self, connections: u32) -> Inbox<Self::Db> {
        let pool = PgPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(self.pool.connect_options().as_ref().clone());
        Inbox::new(pool)
    }

    async fn bulk_rows(&self, consumer: &str, rows: usize) {
        sqlx::query(
            "INSERT INTO idempotent_inbox (consumer, message_key)
             SELECT $1, int8send(g) FROM generate_series(1, $2) g",
        )
        .bind(consumer)
        .bind(rows as i64)
        .execute(&self.pool)
        .await
        .unwrap();
    }

    async fn backdate(&self, consumer: &str, by: Duration) {
        sqlx::query(
            "UPDATE idempotent_inbox SET processed_at = processed_at - $1 * interval '1 millisecond'
             WHERE consumer = $2",
        )
        .bind(by.as_millis() as i64)
        .bind(consumer)
        .execute(&self.pool)
        .await
        .unwrap();
    }

    async fn create_legacy_tables(&self, table: &str) {
        // The DDL of `idempotent-runtime/src/store/postgres.rs` in the first release (schema 1).
        let t = format!("\"{table}\"");
        let index = format!("\"{table}_processed_at\"");
        let calls = format!("\"{table}_calls\"");
        for statement in [
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
        ] {
            sqlx::query(sqlx::AssertSqlSafe(statement))
                .execute(&self.pool)
                .await
                .unwrap();
        }
        let (rows, call_rows) = super::legacy_rows();
        for (key, response, fingerprint) in rows {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {t} (consumer, message_key, response, fingerprint) VALUES ('old-orders', $1, $2, $3)"
            )))
            .bind(key)
            .bind(response)
            .bind(fingerprint)
            .execute(&self.pool)
            .await
            .unwrap();
        }
        for (key, name, completed, result) in call_rows {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {calls} (consumer, message_key, call_name, fence, lease_until, completed, result)
                 VALUES ('old-orders', $1, $2, 1, $3, $4, $5)"
            )))
            .bind(key)
            .bind(name)
            .bind(super::FAR_LEASE_MS)
            .bind(completed)
            .bind(result)
            .execute(&self.pool)
            .await
            .unwrap();
        }
    }

    async fn wait_until_a_claim_blocks(&self) {
        // A claim waiting on another transaction's uncommitted row shows as an ungranted lock
        // requested by one of this test's sessions (named after its schema).
        for _ in 0..500 {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                 WHERE NOT l.granted AND a.application_name = $1
                   AND (a.query LIKE 'INSERT INTO \"idempotent_inbox\" %'
                        OR a.query LIKE 'BEGIN;%EXECUTE idempotent_claim_%')",
            )
            .bind(&self.schema)
            .fetch_one(&self.pool)
            .await
            .unwrap();
            if waiting > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("no claim ever waited on the uncommitted one");
    }
}
