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

/// Creates `schema`, with an `effects` table in it, on `admin`'s database.
pub async fn create_schema_with_effects(admin: &PgPool, schema: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA {schema}; {}",
        CREATE_EFFECTS.replace("effects", &format!("{schema}.effects"))
    )))
    .execute(admin)
    .await
    .unwrap();
}

pub struct PgHarness {
    pub inbox: Inbox<Postgres>,
    pub impatient: Inbox<Postgres>,
    /// Connected to PostgreSQL itself: the harness's own statements, and what the tests look at.
    pub pool: PgPool,
    /// The schema (or, through PgBouncer, the database) of this test; also its sessions'
    /// `application_name`.
    pub schema: String,
    /// The inboxes go through PgBouncer in transaction mode.
    pub pooled: bool,
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
        Self::set_up(
            Inbox::new(pool.clone()),
            Inbox::new(impatient),
            pool,
            schema,
            false,
        )
        .await
    }

    /// A harness whose inboxes reach PostgreSQL through PgBouncer in transaction mode
    /// (`IDEMPOTENT_PGBOUNCER_URL`, which `scripts/pgbouncer start` sets, in front of
    /// `IDEMPOTENT_PGBOUNCER_UPSTREAM_URL`), a fresh database per test (PgBouncer 1.18 passes no
    /// `search_path` on to the server). The inboxes are made `with_transaction_pooling()`, and
    /// their pools as the README says: no statement cache (`statement_cache_capacity(0)`), with
    /// PgBouncer resetting each server session after every transaction
    /// (`server_reset_query_always = 1`), so that the handlers' own `sqlx::query` statements
    /// work inside their transaction. The impatient inbox connects as a role whose
    /// `lock_timeout` is 300 ms, as PgBouncer 1.18 passes no `options` on either.
    pub async fn through_pgbouncer() -> Self {
        let (bouncer, upstream) = pgbouncer_urls();
        let upstream: PgConnectOptions = upstream.parse().expect("the upstream URL");
        let database = format!("t_{}", uuid::Uuid::new_v4().simple());
        let mut admin = upstream.connect().await.expect("connect to PostgreSQL");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
            .execute(&mut admin)
            .await
            .unwrap();
        // The role the impatient inbox connects as; created once per server.
        let _ = sqlx::raw_sql(
            "DO $$ BEGIN
                 CREATE ROLE idempotent_impatient LOGIN SUPERUSER;
             EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$;
             ALTER ROLE idempotent_impatient SET lock_timeout = '300ms'",
        )
        .execute(&mut admin)
        .await;
        let pool = PgPoolOptions::new()
            .max_connections(10)
            .connect_with(upstream.database(&database).application_name(&database))
            .await
            .expect("connect to PostgreSQL");
        let bouncer: PgConnectOptions = bouncer.parse().expect("IDEMPOTENT_PGBOUNCER_URL");
        let bouncer = bouncer
            .database(&database)
            .application_name(&database)
            .statement_cache_capacity(0);
        let inbox = PgPoolOptions::new()
            .max_connections(40)
            .connect_lazy_with(bouncer.clone());
        let impatient = PgPoolOptions::new()
            .max_connections(2)
            .connect_lazy_with(bouncer.username("idempotent_impatient"));
        Self::set_up(
            Inbox::new(inbox).with_transaction_pooling(),
            Inbox::new(impatient).with_transaction_pooling(),
            pool,
            database,
            true,
        )
        .await
    }

    async fn set_up(
        inbox: Inbox<Postgres>,
        impatient: Inbox<Postgres>,
        pool: PgPool,
        schema: String,
        pooled: bool,
    ) -> Self {
        sqlx::query(CREATE_EFFECTS).execute(&pool).await.unwrap();
        for statement in super::CREATE_UNIQUES {
            sqlx::query(statement).execute(&pool).await.unwrap();
        }
        inbox.migrate().await.expect("migrate");
        Self {
            inbox,
            impatient,
            pool,
            schema,
            pooled,
        }
    }
}

/// Through PgBouncer each test has a database of its own (a copy of `template1`, some megabytes):
/// dropped when the test ends, so that a run of the suite leaves none behind.
impl Drop for PgHarness {
    fn drop(&mut self) {
        if !self.pooled {
            return;
        }
        let (_, upstream) = pgbouncer_urls();
        let database = self.schema.clone();
        // Not on the test's runtime, which is dropping this harness.
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let options: PgConnectOptions = upstream.parse().unwrap();
                let mut admin = options.connect().await?;
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DROP DATABASE IF EXISTS {database} WITH (FORCE)"
                )))
                .execute(&mut admin)
                .await
                .map(drop)
            })
        });
        if let Ok(Err(error)) = dropped.join() {
            eprintln!("the test database {} was not dropped: {error}", self.schema);
        }
    }
}

/// PgBouncer's URL and the URL of the PostgreSQL behind it.
pub fn pgbouncer_urls() -> (String, String) {
    let get = |name: &str| {
        std::env::var(name).unwrap_or_else(|_| {
            panic!("{name} is not set: run the tests with scripts/test, which starts PgBouncer")
        })
    };
    (
        get("IDEMPOTENT_PGBOUNCER_URL"),
        get("IDEMPOTENT_PGBOUNCER_UPSTREAM_URL"),
    )
}

impl PgHarness {
    /// The same harness whose inboxes send the claim in one message with its `BEGIN`.
    pub fn with_pipelined_claim(mut self) -> Self {
        self.inbox = self.inbox.clone().with_pipelined_claim();
        self.impatient = self.impatient.clone().with_pipelined_claim();
        self
    }
}

impl Harness for PgHarness {
    crate::support::harness_methods!("$1", "$2");

    type Db = Postgres;

    fn inbox_with_pool(&self, connections: u32) -> Inbox<Self::Db> {
        let pool = PgPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(self.inbox.pool().connect_options().as_ref().clone());
        let inbox = Inbox::new(pool);
        if self.pooled {
            inbox.with_transaction_pooling()
        } else {
            inbox
        }
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
                 WHERE NOT l.granted AND a.datname = current_database()
                   AND (a.application_name = $1 OR $2)
                   AND (a.query LIKE 'INSERT INTO \"idempotent_inbox\" %'
                        OR a.query LIKE 'BEGIN;%EXECUTE idempotent_claim_%')",
            )
            .bind(&self.schema)
            // Through PgBouncer, the test has a database of its own.
            .bind(self.pooled)
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
