//! What the consumer examples share, whatever the broker: the payment event, the ledger with its
//! `#[idempotent]` handler on each database, and the worker the broker runner drives.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent::broker::{Message, RunnerStats, Shutdown};
use idempotent::{Error, Handled};
use serde::{Deserialize, Serialize};

/// The event on the queue. Its stable id travels as the broker's message id (AMQP `message_id`,
/// NATS `Nats-Msg-Id`), which the producer sets once per message and keeps when it retries.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PaymentReceived {
    pub order_id: i64,
    pub amount_cents: i64,
}

/// `--name value` from the command line.
pub fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// The message the handler sees: the producer's id and the payload.
pub struct Payment {
    pub message_id: String,
    pub event: PaymentReceived,
}

/// The handler's error.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("database error")]
    Db(#[from] sqlx::Error),
    #[error("the payload is not a payment")]
    NotAPayment(#[from] serde_json::Error),
}

/// The handler, for each database the example runs on.
macro_rules! ledger_on {
    ($conn:ty) => {
        use idempotent::idempotent;

        use super::Payment;

        #[idempotent(key = "message_id", consumer = "ledger")]
        pub async fn on_payment(tx: &mut $conn, msg: &Payment) -> Result<(), super::LedgerError> {
            sqlx::query(
                "INSERT INTO ledger (message_id, order_id, amount_cents) VALUES ($1, $2, $3)",
            )
            .bind(&msg.message_id)
            .bind(msg.event.order_id)
            .bind(msg.event.amount_cents)
            .execute(&mut *tx)
            .await?;
            Ok(())
        }
    };
}

mod on_sqlite {
    ledger_on!(sqlx::SqliteConnection);
}

#[cfg(feature = "postgres")]
mod on_postgres {
    ledger_on!(sqlx::PgConnection);
}

#[derive(Clone)]
pub enum Ledger {
    Sqlite(idempotent::Inbox<sqlx::Sqlite>),
    #[cfg(feature = "postgres")]
    Postgres(idempotent::Inbox<sqlx::Postgres>),
}

const LEDGER: &str = "CREATE TABLE IF NOT EXISTS ledger (
    message_id TEXT NOT NULL, order_id BIGINT NOT NULL, amount_cents BIGINT NOT NULL)";

impl Ledger {
    pub async fn open(url: &str) -> Result<Self, Box<dyn std::error::Error>> {
        if url.starts_with("postgres") {
            #[cfg(feature = "postgres")]
            {
                let pool = sqlx::PgPool::connect(url).await?;
                sqlx::query(LEDGER).execute(&pool).await?;
                let inbox = idempotent::Inbox::new(pool);
                inbox.migrate().await?;
                return Ok(Ledger::Postgres(inbox));
            }
            #[cfg(not(feature = "postgres"))]
            return Err("a PostgreSQL DATABASE_URL needs `--features postgres`".into());
        }
        let pool =
            sqlx::SqlitePool::connect_with(idempotent::sqlite::connect_options(url)?).await?;
        sqlx::query(LEDGER).execute(&pool).await?;
        let inbox = idempotent::Inbox::new(pool);
        inbox.migrate().await?;
        Ok(Ledger::Sqlite(inbox))
    }

    /// The same ledger with a worker's inbox.
    pub fn for_worker(&self) -> Self {
        match self {
            Ledger::Sqlite(inbox) => Ledger::Sqlite(inbox.for_worker()),
            #[cfg(feature = "postgres")]
            Ledger::Postgres(inbox) => Ledger::Postgres(inbox.for_worker()),
        }
    }

    pub async fn handle(&self, msg: &Payment) -> Result<Handled<()>, Error<LedgerError>> {
        match self {
            Ledger::Sqlite(inbox) => on_sqlite::on_payment(inbox, msg).await,
            #[cfg(feature = "postgres")]
            Ledger::Postgres(inbox) => on_postgres::on_payment(inbox, msg).await,
        }
    }
}

/// A worker's handler: decodes the payment, calls the ledger's handler with a worker's inbox, and
/// prints what happened; after the `pause_after`-th commit of the process it stops before the
/// runner can acknowledge (for the test that kills it there).
pub fn worker(
    ledger: &Ledger,
    commits: &Arc<AtomicUsize>,
    pause_after: Option<usize>,
) -> impl FnMut(Message) -> futures::future::BoxFuture<'static, Result<Handled<()>, Error<LedgerError>>>
+ Send
+ 'static {
    let ledger = ledger.for_worker();
    let commits = commits.clone();
    move |message: Message| {
        let ledger = ledger.clone();
        let commits = commits.clone();
        Box::pin(async move {
            let line = format!(
                "{} tag={} redelivered={}",
                message.message_id, message.delivery_tag, message.redelivered.0
            );
            let event = match serde_json::from_slice::<PaymentReceived>(&message.payload) {
                Ok(event) => event,
                Err(error) => {
                    println!("REJECTED {line} (not a payment)");
                    return Err(Error::Handler(error.into()));
                }
            };
            let payment = Payment {
                message_id: message.message_id.0,
                event,
            };
            let outcome = ledger.handle(&payment).await;
            match &outcome {
                Ok(handled) if handled.is_processed() => {
                    println!("PROCESSED {line}");
                    let committed = commits.fetch_add(1, Ordering::SeqCst) + 1;
                    if pause_after == Some(committed) {
                        println!(
                            "PAUSED after the commit of {}, before its ack",
                            payment.message_id
                        );
                        std::future::pending::<()>().await;
                    }
                }
                Ok(_) => println!("DUPLICATE {line}"),
                Err(error) if error.is_retryable() => println!("RETRY {line}: {error}"),
                Err(error) => println!("DEAD-LETTER {line}: {error}"),
            }
            outcome
        })
    }
}

/// Prints what the runner counted.
pub fn report(stats: RunnerStats) {
    println!(
        "IDLE: {} processed, {} duplicates, {} retried, {} dead-lettered",
        stats.processed, stats.duplicates, stats.retried, stats.dead_lettered
    );
}

/// Cancels `shutdown` once the runner's counters have not moved for `idle`.
pub fn stop_when_idle(
    stats: impl Fn() -> RunnerStats + Send + 'static,
    idle: Duration,
    shutdown: Shutdown,
) {
    tokio::spawn(async move {
        let (mut last, mut since) = (stats(), tokio::time::Instant::now());
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = stats();
            if now != last {
                (last, since) = (now, tokio::time::Instant::now());
            } else if since.elapsed() >= idle {
                shutdown.cancel();
                return;
            }
        }
    });
}
