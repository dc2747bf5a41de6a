//! A fresh SQLite database file per test.

use std::time::Duration;

use idempotent::Inbox;
use sqlx::Sqlite;
use sqlx::sqlite::{SqlitePool, SqlitePoolOptions};

use super::{CREATE_EFFECTS, Consumer, Delivery, Harness, Outcome};

mod handlers {
    crate::support::effect_handlers!(
        sqlx::SqliteConnection,
        "INSERT INTO effects (consumer, label) VALUES ($1, $2)"
    );
}

pub struct SqliteHarness {
    pub inbox: Inbox<Sqlite>,
    pub pool: SqlitePool,
    _dir: tempfile::TempDir,
}

impl SqliteHarness {
    pub async fn new() -> Self {
        let dir = tempfile::tempdir().expect("temporary folder");
        let url = format!("sqlite://{}", dir.path().join("inbox.db").display());
        let pool = SqlitePoolOptions::new()
            .max_connections(40)
            .connect_with(idempotent::sqlite::connect_options(&url).unwrap())
            .await
            .expect("open the SQLite file");
        sqlx::query(CREATE_EFFECTS).execute(&pool).await.unwrap();
        let inbox = Inbox::new(pool.clone());
        inbox.migrate().await.expect("migrate");
        Self {
            inbox,
            pool,
            _dir: dir,
        }
    }
}

impl Harness for SqliteHarness {
    type Db = Sqlite;

    fn inbox(&self) -> &Inbox<Sqlite> {
        &self.inbox
    }

    async fn deliver(&self, consumer: Consumer, msg: &Delivery) -> Outcome {
        handlers::deliver(&self.inbox, consumer, msg).await
    }

    async fn effects(&self, label: &str) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM effects WHERE label = $1")
            .bind(label)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn effects_of(&self, consumer: &str, label: &str) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM effects WHERE consumer = $1 AND label = $2")
            .bind(consumer)
            .bind(label)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn inbox_rows(&self) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM idempotent_inbox")
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    async fn wait_until_a_claim_blocks(&self) {
        // SQLite shows no lock waits; a claim that did not wait would be done well within this.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}
