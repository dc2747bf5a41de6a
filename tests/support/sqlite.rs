//! A fresh SQLite database file per test.

use std::time::Duration;

use idempotent::Inbox;
use sqlx::Sqlite;
use sqlx::sqlite::{SqlitePool, SqlitePoolOptions};

use super::{CREATE_EFFECTS, Consumer, Delivery, Harness, Outcome, Quote};

mod handlers {
    crate::support::effect_handlers!(
        sqlx::SqliteConnection,
        "INSERT INTO effects (consumer, label) VALUES ($1, $2)"
    );
}

pub struct SqliteHarness {
    pub inbox: Inbox<Sqlite>,
    pub impatient: Inbox<Sqlite>,
    pub pool: SqlitePool,
    _dir: Option<tempfile::TempDir>,
}

impl SqliteHarness {
    pub async fn new() -> Self {
        let dir = tempfile::tempdir().expect("temporary folder");
        let url = format!("sqlite://{}", dir.path().join("inbox.db").display());
        let options = idempotent::sqlite::connect_options(&url).unwrap();
        let pool = SqlitePoolOptions::new()
            .max_connections(40)
            .connect_with(options.clone())
            .await
            .expect("open the SQLite file");
        let impatient = SqlitePoolOptions::new()
            .max_connections(2)
            .connect_lazy_with(options.busy_timeout(Duration::from_millis(300)));
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
            _dir: Some(dir),
        }
    }

    /// The in-memory inbox users test their own handlers with: one connection, so the impatient
    /// delivery is one that cannot get it in time (a pool timeout).
    pub async fn in_memory() -> Self {
        let inbox = Inbox::<Sqlite>::in_memory().await.expect("in-memory inbox");
        let pool = inbox.pool().clone();
        sqlx::query(CREATE_EFFECTS).execute(&pool).await.unwrap();
        for statement in super::CREATE_UNIQUES {
            sqlx::query(statement).execute(&pool).await.unwrap();
        }
        Self {
            impatient: inbox.clone(),
            inbox,
            pool,
            _dir: None,
        }
    }
}

impl Harness for SqliteHarness {
    crate::support::harness_methods!("$1", "$2");

    type Db = Sqlite;

    fn one_writer(&self) -> bool {
        true
    }

    fn inbox_with_pool(&self, connections: u32) -> Inbox<Self::Db> {
        if self._dir.is_none() {
            return self.inbox.clone(); // the in-memory database has one connection already
        }
        let pool = SqlitePoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(self.pool.connect_options().as_ref().clone());
        Inbox::new(pool)
    }

    async fn bulk_rows(&self, consumer: &str, rows: usize) {
        sqlx::query(
            "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n WHERE x < $2)
             INSERT INTO idempotent_inbox (consumer, message_key, processed_at)
             SELECT $1, CAST(x AS BLOB), CAST(unixepoch('subsec') * 1000 AS INTEGER) FROM n",
        )
        .bind(consumer)
        .bind(rows as i64)
        .execute(&self.pool)
        .await
        .unwrap();
    }

    async fn backdate(&self, consumer: &str, by: Duration) {
        sqlx::query(
            "UPDATE idempotent_inbox SET processed_at = processed_at - $1 WHERE consumer = $2",
        )
        .bind(by.as_millis() as i64)
        .bind(consumer)
        .execute(&self.pool)
        .await
        .unwrap();
    }

    async fn create_legacy_tables(&self, table: &str) {
        // The DDL of `idempotent-runtime/src/store/sqlite.rs` in the first release (schema 1).
        let t = format!("\"{table}\"");
        let index = format!("\"{table}_processed_at\"");
        let calls = format!("\"{table}_calls\"");
        for statement in [
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
        ] {
            sqlx::query(sqlx::AssertSqlSafe(statement))
                .execute(&self.pool)
                .await
                .unwrap();
        }
        let (rows, call_rows) = super::legacy_rows();
        for (key, response, fingerprint) in rows {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {t} (consumer, message_key, processed_at, response, fingerprint)
                 VALUES ('old-orders', $1, CAST(unixepoch('subsec') * 1000 AS INTEGER), $2, $3)"
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
        // SQLite shows no lock waits; a claim that did not wait would be done well within this.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}
