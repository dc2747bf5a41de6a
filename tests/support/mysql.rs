//! A fresh database per test in the MySQL or MariaDB that `IDEMPOTENT_MYSQL_URL` points to.

use std::time::Duration;

use idempotent::Inbox;
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::{ConnectOptions, MySql};

use super::{CREATE_EFFECTS, Consumer, Delivery, Harness, Outcome, Quote};

mod handlers {
    crate::support::effect_handlers!(
        sqlx::MySqlConnection,
        "INSERT INTO effects (consumer, label) VALUES (?, ?)"
    );
}

/// The server the tests run against. `scripts/test` starts one; CI does too.
pub fn url() -> String {
    std::env::var("IDEMPOTENT_MYSQL_URL").expect(
        "IDEMPOTENT_MYSQL_URL is not set: run the tests with scripts/test, which starts MariaDB",
    )
}

pub struct MySqlHarness {
    pub inbox: Inbox<MySql>,
    pub impatient: Inbox<MySql>,
    pub pool: MySqlPool,
    pub database: String,
}

impl MySqlHarness {
    pub async fn new() -> Self {
        let options: MySqlConnectOptions = url().parse().expect("IDEMPOTENT_MYSQL_URL");
        let database = format!("t_{}", uuid::Uuid::new_v4().simple());
        let mut admin = options.connect().await.expect("connect to MySQL");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
            .execute(&mut admin)
            .await
            .unwrap();
        let options = options.database(&database);
        let pool = MySqlPoolOptions::new()
            .max_connections(40)
            .connect_with(options.clone())
            .await
            .expect("connect to MySQL");
        let impatient = MySqlPoolOptions::new()
            .max_connections(2)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    sqlx::query("SET SESSION innodb_lock_wait_timeout = 1")
                        .execute(conn)
                        .await
                        .map(drop)
                })
            })
            .connect_lazy_with(options);
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
            database,
        }
    }
}

impl Harness for MySqlHarness {
    crate::support::harness_methods!("?", "?");

    type Db = MySql;

    fn inbox_with_pool(&self, connections: u32) -> Inbox<Self::Db> {
        let pool = MySqlPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(self.pool.connect_options().as_ref().clone());
        Inbox::new(pool)
    }

    async fn bulk_rows(&self, consumer: &str, rows: usize) {
        // MariaDB's sequence engine: seq_1_to_N is a table of the numbers 1 to N.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO idempotent_inbox (consumer, message_key, processed_at)
             SELECT ?, CAST(seq AS BINARY), UTC_TIMESTAMP(6) FROM seq_1_to_{rows}"
        )))
        .bind(consumer)
        .execute(&self.pool)
        .await
        .unwrap();
    }

    async fn backdate(&self, consumer: &str, by: Duration) {
        sqlx::query(
            "UPDATE idempotent_inbox SET processed_at = processed_at - INTERVAL (? * 1000) MICROSECOND
             WHERE consumer = ?",
        )
        .bind(by.as_millis() as i64)
        .bind(consumer)
        .execute(&self.pool)
        .await
        .unwrap();
    }

    async fn create_legacy_tables(&self, table: &str) {
        // The DDL of `idempotent-runtime/src/store/mysql.rs` in the first release (schema 1).
        let t = format!("`{table}`");
        let index = format!("`{table}_processed_at`");
        let calls = format!("`{table}_calls`");
        for statement in [
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
                 VALUES ('old-orders', ?, UTC_TIMESTAMP(6), ?, ?)"
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
                 VALUES ('old-orders', ?, ?, 1, ?, ?, ?)"
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
        // InnoDB's own lock-wait view (INNODB_TRX) is a cache refreshed at most every 100 ms while
        // it is read, so it can miss a wait for as long as it is polled; the process list is live.
        // A claim of this test's database that has been inserting for 200 ms is waiting on a lock:
        // an insert that does not wait takes microseconds. (TIME_MS is MariaDB's.)
        for _ in 0..500 {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST
                 WHERE DB = ? AND INFO LIKE 'INSERT IGNORE INTO `idempotent_inbox`%' AND TIME_MS > 200",
            )
            .bind(&self.database)
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
