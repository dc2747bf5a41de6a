//! Consumes payment events from RabbitMQ with an `#[idempotent]` handler, as a service would:
//!
//! - `Processed` or `Duplicate`: acknowledge (the effect is committed, by this delivery or an
//!   earlier one);
//! - a retryable error (deadlock, busy database, lost connection): negatively acknowledge with
//!   requeue, so the broker delivers it again;
//! - any other error (the handler's own, an empty or missing message id): negatively acknowledge
//!   without requeue, so the message goes to the dead-letter exchange, if the queue has one.
//!
//! The key is the producer's `message_id` property, never the delivery tag: the broker gives every
//! delivery a new tag, and restarts counting on every channel.
//!
//! ```text
//! cargo run --example rabbitmq_consumer -- --queue payments                  # SQLite
//! DATABASE_URL=postgres://… cargo run --example rabbitmq_consumer --features postgres -- --queue payments
//! ```
//!
//! `--exit-when-idle SECONDS` stops once the queue has been empty that long; `--pause-after-commit N`
//! stops after the N-th commit, before its acknowledgement, and says so on stdout (for the test that
//! kills it there).

#[path = "rabbitmq/common.rs"]
mod common;

use std::time::Duration;

use common::{PaymentReceived, arg, channel};
use futures::StreamExt;
use idempotent::{Error, Handled};
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::FieldTable;

/// The message the handler sees: the producer's id and the payload.
pub struct Payment {
    pub message_id: String,
    pub event: PaymentReceived,
}

/// The handler, for each database the example runs on.
macro_rules! ledger_on {
    ($conn:ty) => {
        use idempotent::idempotent;

        use super::Payment;

        #[idempotent(key = "message_id", consumer = "ledger")]
        pub async fn on_payment(tx: &mut $conn, msg: &Payment) -> Result<(), sqlx::Error> {
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

enum Ledger {
    Sqlite(idempotent::Inbox<sqlx::Sqlite>),
    #[cfg(feature = "postgres")]
    Postgres(idempotent::Inbox<sqlx::Postgres>),
}

const LEDGER: &str = "CREATE TABLE IF NOT EXISTS ledger (
    message_id TEXT NOT NULL, order_id BIGINT NOT NULL, amount_cents BIGINT NOT NULL)";

impl Ledger {
    async fn open(url: &str) -> Result<Self, Box<dyn std::error::Error>> {
        if url.starts_with("postgres") {
            #[cfg(feature = "postgres")]
            {
                let pool = sqlx::PgPool::connect(url).await?;
                sqlx::query(LEDGER).execute(&pool).await?;
                let inbox = idempotent::Inbox::new(pool);
                inbox.migrate().await?;
                // One delivery at a time: keep the connection from one to the next.
                return Ok(Ledger::Postgres(inbox.for_worker()));
            }
            #[cfg(not(feature = "postgres"))]
            return Err("a PostgreSQL DATABASE_URL needs `--features postgres`".into());
        }
        let pool =
            sqlx::SqlitePool::connect_with(idempotent::sqlite::connect_options(url)?).await?;
        sqlx::query(LEDGER).execute(&pool).await?;
        let inbox = idempotent::Inbox::new(pool);
        inbox.migrate().await?;
        Ok(Ledger::Sqlite(inbox.for_worker()))
    }

    async fn handle(&self, msg: &Payment) -> Result<Handled<()>, Error<sqlx::Error>> {
        match self {
            Ledger::Sqlite(inbox) => on_sqlite::on_payment(inbox, msg).await,
            #[cfg(feature = "postgres")]
            Ledger::Postgres(inbox) => on_postgres::on_payment(inbox, msg).await,
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let queue = arg("--queue").unwrap_or_else(|| "payments".into());
    let idle = arg("--exit-when-idle").map(|s| Duration::from_secs(s.parse().expect("seconds")));
    let pause_after: Option<usize> = arg("--pause-after-commit").map(|n| n.parse().expect("N"));
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "sqlite://ledger.db".into());
    let ledger = Ledger::open(&url).await?;

    let (_connection, channel) = channel(&queue).await?;
    // One unacknowledged delivery at a time: a crash leaves exactly one to redeliver.
    channel.basic_qos(1, BasicQosOptions::default()).await?;
    let mut deliveries = channel
        .basic_consume(
            queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;

    let mut commits = 0;
    loop {
        let next = match idle {
            Some(idle) => match tokio::time::timeout(idle, deliveries.next()).await {
                Ok(next) => next,
                Err(_) => break, // the queue stayed empty
            },
            None => deliveries.next().await,
        };
        let Some(delivery) = next else { break };
        let delivery = delivery?;
        let message_id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_owned());
        let event = serde_json::from_slice::<PaymentReceived>(&delivery.data);
        let (Some(message_id), Ok(event)) = (message_id, event) else {
            println!(
                "REJECTED tag={} (no message id, or not a payment)",
                delivery.delivery_tag
            );
            delivery.nack(BasicNackOptions::default()).await?;
            continue;
        };
        let outcome = ledger
            .handle(&Payment {
                message_id: message_id.clone(),
                event,
            })
            .await;
        let line = format!(
            "{message_id} tag={} redelivered={}",
            delivery.delivery_tag, delivery.redelivered
        );
        match outcome {
            Ok(handled) => {
                let what = if handled.is_processed() {
                    "PROCESSED"
                } else {
                    "DUPLICATE"
                };
                println!("{what} {line}");
                if handled.is_processed() {
                    commits += 1;
                    if pause_after == Some(commits) {
                        println!("PAUSED after the commit of {message_id}, before its ack");
                        std::future::pending::<()>().await;
                    }
                }
                delivery.ack(BasicAckOptions::default()).await?;
            }
            Err(error) if error.is_retryable() => {
                println!("RETRY {line}: {error}");
                delivery
                    .nack(BasicNackOptions {
                        requeue: true,
                        ..Default::default()
                    })
                    .await?;
            }
            Err(error) => {
                println!("DEAD-LETTER {line}: {error}");
                delivery.nack(BasicNackOptions::default()).await?;
            }
        }
    }
    println!("IDLE");
    Ok(())
}
