//! A consumer process: reads deliveries from stdin, runs the `#[idempotent]` handlers, writes
//! acknowledgements to stdout. At a delivery's crash point it says so and waits to be killed.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use idempotent::{Error, Handled};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::protocol::{CrashPoint, Delivery, Reply, Target};

/// The handler's own error.
#[derive(Debug, thiserror::Error)]
pub enum ChaosError {
    #[error("the handler failed on purpose")]
    Failed,
    #[error("database error in the handler")]
    Db(#[from] sqlx::Error),
}

/// Writes one reply line and flushes it, so the broker sees it before anything else happens.
pub fn reply(reply: Reply) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{reply}");
    let _ = out.flush();
}

/// Stops here if this is the delivery's crash point: tells the broker, which kills the process.
pub async fn crash_point(delivery: &Delivery, point: CrashPoint) {
    if delivery.crash_at == Some(point) {
        reply(Reply::Paused {
            tag: delivery.tag,
            point,
        });
        std::future::pending::<()>().await;
    }
}

/// The handlers, for one connection type.
macro_rules! chaos_handlers {
    ($conn:ty) => {
        use idempotent::idempotent;

        use crate::consumer::{ChaosError, crash_point};
        use crate::protocol::{Behaviour, CrashPoint, Delivery};

        /// The part of both handlers' bodies that the crash points cut into: records the
        /// delivery in `insert`'s table, then fails if the message is meant to.
        async fn record(tx: &mut $conn, insert: &str, msg: &Delivery) -> Result<(), ChaosError> {
            crash_point(msg, CrashPoint::AfterClaim).await;
            sqlx::query(sqlx::AssertSqlSafe(insert))
                .bind(msg.message_id.to_string())
                .bind(msg.tag as i64)
                .execute(&mut *tx)
                .await?;
            crash_point(msg, CrashPoint::InBody).await;
            let fails = msg.behaviour == Behaviour::Poison
                || (msg.behaviour == Behaviour::FailOnce && msg.attempt == 1);
            if fails {
                Err(ChaosError::Failed)
            } else {
                Ok(())
            }
        }

        #[idempotent(key = "message_id", consumer = "ledger")]
        pub async fn ledger(tx: &mut $conn, msg: &Delivery) -> Result<(), ChaosError> {
            record(
                tx,
                "INSERT INTO chaos_ledger (message_id, tag) VALUES ($1, $2)",
                msg,
            )
            .await?;
            sqlx::query("UPDATE chaos_counter SET value = value + 1 WHERE name = 'ledger'")
                .execute(&mut *tx)
                .await?;
            Ok(())
        }

        #[idempotent(key = "message_id", consumer = "mailer")]
        pub async fn mailer(tx: &mut $conn, msg: &Delivery) -> Result<(), ChaosError> {
            record(
                tx,
                "INSERT INTO chaos_emails (message_id, tag) VALUES ($1, $2)",
                msg,
            )
            .await
        }
    };
}

mod on_postgres {
    chaos_handlers!(sqlx::PgConnection);
}

mod on_sqlite {
    chaos_handlers!(sqlx::SqliteConnection);
}

type Outcome = Result<Handled<()>, Error<ChaosError>>;

/// The inbox of the database the run uses.
#[derive(Clone)]
enum Shop {
    Postgres(idempotent::Inbox<sqlx::Postgres>),
    Sqlite(idempotent::Inbox<sqlx::Sqlite>),
}

impl Shop {
    async fn handle(&self, delivery: &Delivery) -> Outcome {
        match (self, delivery.target) {
            (Shop::Postgres(inbox), Target::Ledger) => on_postgres::ledger(inbox, delivery).await,
            (Shop::Postgres(inbox), Target::Mailer) => on_postgres::mailer(inbox, delivery).await,
            (Shop::Sqlite(inbox), Target::Ledger) => on_sqlite::ledger(inbox, delivery).await,
            (Shop::Sqlite(inbox), Target::Mailer) => on_sqlite::mailer(inbox, delivery).await,
        }
    }
}

/// The consumer process's main loop.
pub async fn run(url: &str) {
    let shop = if url.starts_with("postgres") {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(3))
            .connect_lazy(url)
            .expect("PostgreSQL URL");
        Shop::Postgres(idempotent::Inbox::new(pool))
    } else {
        let options = idempotent::sqlite::connect_options(url)
            .expect("SQLite URL")
            .busy_timeout(Duration::from_secs(10));
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(4)
            .connect_lazy_with(options);
        Shop::Sqlite(idempotent::Inbox::new(pool))
    };
    let shop = Arc::new(shop);
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let delivery: Delivery = line.parse().expect("a delivery from the broker");
        let shop = shop.clone();
        tokio::spawn(async move {
            crash_point(&delivery, CrashPoint::BeforeClaim).await;
            let outcome = shop.handle(&delivery).await;
            match outcome {
                Ok(handled) => {
                    crash_point(&delivery, CrashPoint::AfterCommit).await;
                    reply(Reply::Ack {
                        tag: delivery.tag,
                        duplicate: handled.is_duplicate(),
                    });
                }
                Err(error) => {
                    // The outcome's own classification, whatever the handler's error type: a
                    // database failure under the body is `Error::Transient`.
                    let retryable = error.is_retryable();
                    if !retryable && !matches!(error, Error::Handler(ChaosError::Failed)) {
                        eprintln!("consumer: delivery {} failed: {error:?}", delivery.tag);
                    }
                    reply(Reply::Nack {
                        tag: delivery.tag,
                        retryable,
                    });
                }
            }
        });
    }
    // The broker closed our stdin: no more deliveries. In-flight ones are the broker's to requeue.
}
