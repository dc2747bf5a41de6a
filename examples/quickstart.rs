//! A little broker that delivers at least once, and a shop whose payment handler is `#[idempotent]`.
//!
//! The broker redelivers a message whose consumer crashed before acknowledging it, hands two copies
//! of one message to two consumers at the same moment, and has a message resubmitted from its
//! dead-letter queue later. Every delivery is printed with what the handler did, and at the end the
//! shop's state shows each effect once.
//!
//! ```text
//! cargo run --example quickstart                                  # SQLite, no setup
//! DATABASE_URL=postgres://user@host/db cargo run --example quickstart --features postgres
//! DATABASE_URL=mysql://user:pass@host/db cargo run --example quickstart --features mysql
//! ```

use std::collections::VecDeque;
use std::future::Future;

use idempotent::{Error, Handled};
use uuid::Uuid;

/// The event the payment service publishes. `message_id` is assigned once by the producer and
/// travels with every delivery; the broker's delivery tag does not (see [`Delivery`]).
#[derive(Debug, Clone)]
pub struct PaymentReceived {
    pub message_id: Uuid,
    pub order_id: i64,
    pub payment_id: String,
    pub amount_cents: i64,
}

/// The handler's own error.
#[derive(Debug, thiserror::Error)]
pub enum ShopError {
    #[error("order {0} does not exist")]
    UnknownOrder(i64),
    #[error("database error")]
    Db(#[from] sqlx::Error),
}

/// The handler's statements, in the placeholder style of each database.
pub struct Statements {
    pay: &'static str,
    email: &'static str,
    revenue: &'static str,
}

/// PostgreSQL's `$1` (which SQLite understands too).
pub const NUMBERED: Statements = Statements {
    pay: "UPDATE orders SET status = 'paid', payment_id = $1 WHERE id = $2",
    email: "INSERT INTO emails (order_id, kind) VALUES ($1, 'payment-confirmation')",
    revenue: "UPDATE counters SET value = value + $1 WHERE name = 'revenue_cents'",
};

/// MySQL's `?`.
pub const POSITIONAL: Statements = Statements {
    pay: "UPDATE orders SET status = 'paid', payment_id = ? WHERE id = ?",
    email: "INSERT INTO emails (order_id, kind) VALUES (?, 'payment-confirmation')",
    revenue: "UPDATE counters SET value = value + ? WHERE name = 'revenue_cents'",
};

/// The shop's handler, written once for each database the example can run on. In an application
/// there is one connection type, the SQL is inline and there is no `macro_rules!`: the function
/// inside is all you write.
macro_rules! shop_on {
    ($conn:ty, $sql:expr) => {
        use idempotent::idempotent;

        use super::{PaymentReceived, ShopError, Statements};

        const SQL: Statements = $sql;

        /// Marks the order paid, queues one confirmation email and adds the amount to the revenue
        /// counter: an effect that must not happen twice.
        #[idempotent(key = "message_id", consumer = "orders")]
        pub async fn on_payment_received(
            tx: &mut $conn,
            msg: &PaymentReceived,
        ) -> Result<(), ShopError> {
            let updated = sqlx::query(SQL.pay)
                .bind(&msg.payment_id)
                .bind(msg.order_id)
                .execute(&mut *tx)
                .await?;
            if updated.rows_affected() == 0 {
                return Err(ShopError::UnknownOrder(msg.order_id));
            }
            sqlx::query(SQL.email)
                .bind(msg.order_id)
                .execute(&mut *tx)
                .await?;
            sqlx::query(SQL.revenue)
                .bind(msg.amount_cents)
                .execute(&mut *tx)
                .await?;
            Ok(())
        }
    };
}

mod on_sqlite {
    shop_on!(sqlx::SqliteConnection, super::NUMBERED);
}

#[cfg(feature = "postgres")]
mod on_postgres {
    shop_on!(sqlx::PgConnection, super::NUMBERED);
}

#[cfg(feature = "mysql")]
mod on_mysql {
    shop_on!(sqlx::MySqlConnection, super::POSITIONAL);
}

/// One delivery of a message: the broker gives each its own tag.
struct Delivery {
    tag: u64,
    msg: PaymentReceived,
    why: &'static str,
}

/// A broker that delivers at least once: unacknowledged deliveries come back with a new tag.
#[derive(Default)]
struct Broker {
    queue: VecDeque<Delivery>,
    dead_letters: Vec<PaymentReceived>,
    next_tag: u64,
}

impl Broker {
    fn publish(&mut self, msg: PaymentReceived, why: &'static str) {
        self.next_tag += 1;
        self.queue.push_back(Delivery {
            tag: self.next_tag,
            msg,
            why,
        });
    }

    fn next(&mut self) -> Option<Delivery> {
        self.queue.pop_front()
    }
}

/// The shop on one database: its handler and a look at its state.
trait Shop {
    fn handle(
        &self,
        msg: &PaymentReceived,
    ) -> impl Future<Output = Result<Handled<()>, Error<ShopError>>>;
    fn state(&self) -> impl Future<Output = Result<State, sqlx::Error>>;
}

#[derive(Debug, PartialEq)]
struct State {
    paid_orders: Vec<(i64, String)>,
    emails: i64,
    revenue_cents: i64,
    inbox_rows: i64,
}

const SCHEMA: [&str; 6] = [
    "DROP TABLE IF EXISTS orders",
    "DROP TABLE IF EXISTS emails",
    "DROP TABLE IF EXISTS counters",
    "CREATE TABLE orders (id BIGINT PRIMARY KEY, status TEXT NOT NULL, payment_id TEXT)",
    "CREATE TABLE emails (order_id BIGINT NOT NULL, kind TEXT NOT NULL)",
    "CREATE TABLE counters (name VARCHAR(64) PRIMARY KEY, value BIGINT NOT NULL)",
];
const SEED: [&str; 3] = [
    "INSERT INTO orders (id, status) VALUES (1, 'open'), (2, 'open'), (3, 'open')",
    "INSERT INTO counters (name, value) VALUES ('revenue_cents', 0)",
    "DELETE FROM idempotent_inbox WHERE consumer = 'orders'",
];

/// Sets up one database for the example: the shop's tables, the inbox, a fresh start.
macro_rules! shop_impl {
    ($shop:ident, $db:ty, $module:ident) => {
        struct $shop {
            inbox: idempotent::Inbox<$db>,
        }

        impl $shop {
            async fn open(pool: sqlx::Pool<$db>) -> Result<Self, Box<dyn std::error::Error>> {
                for statement in SCHEMA {
                    sqlx::query(statement).execute(&pool).await?;
                }
                let inbox = idempotent::Inbox::new(pool.clone());
                inbox.migrate().await?;
                for statement in SEED {
                    sqlx::query(statement).execute(&pool).await?;
                }
                Ok(Self { inbox })
            }
        }

        impl Shop for $shop {
            async fn handle(&self, msg: &PaymentReceived) -> Result<Handled<()>, Error<ShopError>> {
                $module::on_payment_received(&self.inbox, msg).await
            }

            async fn state(&self) -> Result<State, sqlx::Error> {
                let pool = self.inbox.pool();
                Ok(State {
                    paid_orders: sqlx::query_as(
                        "SELECT id, payment_id FROM orders WHERE status = 'paid' ORDER BY id",
                    )
                    .fetch_all(pool)
                    .await?,
                    emails: sqlx::query_scalar("SELECT COUNT(*) FROM emails")
                        .fetch_one(pool)
                        .await?,
                    revenue_cents: sqlx::query_scalar(
                        "SELECT value FROM counters WHERE name = 'revenue_cents'",
                    )
                    .fetch_one(pool)
                    .await?,
                    inbox_rows: sqlx::query_scalar(
                        "SELECT COUNT(*) FROM idempotent_inbox WHERE consumer = 'orders'",
                    )
                    .fetch_one(pool)
                    .await?,
                })
            }
        }
    };
}

shop_impl!(SqliteShop, sqlx::Sqlite, on_sqlite);
#[cfg(feature = "postgres")]
shop_impl!(PostgresShop, sqlx::Postgres, on_postgres);
#[cfg(feature = "mysql")]
shop_impl!(MySqlShop, sqlx::MySql, on_mysql);

fn describe(outcome: &Result<Handled<()>, Error<ShopError>>) -> String {
    match outcome {
        Ok(Handled::Processed(())) => {
            "processed: order paid, email queued, revenue counted → ack".into()
        }
        Ok(Handled::Duplicate { .. }) => "duplicate: already processed, body skipped → ack".into(),
        Err(e) if e.is_retryable() => format!("{} → nack, requeue", chain(e)),
        Err(e) => format!("{} → dead-letter", chain(e)),
    }
}

/// An error and its causes, `outer: inner: innermost`.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text = format!("{text}: {cause}");
        source = cause.source();
    }
    text
}

async fn handle_and_print(shop: &impl Shop, delivery: &Delivery) {
    let outcome = shop.handle(&delivery.msg).await;
    println!(
        "delivery {:>2}  order {}  {:<44} {}",
        delivery.tag,
        delivery.msg.order_id,
        delivery.why,
        describe(&outcome)
    );
}

async fn simulate(shop: &impl Shop) -> Result<State, Box<dyn std::error::Error>> {
    let payment = |order_id: i64, amount_cents: i64| PaymentReceived {
        message_id: Uuid::new_v4(),
        order_id,
        payment_id: format!("pay-{order_id}"),
        amount_cents,
    };
    let (first, second, third) = (payment(1, 1250), payment(2, 4000), payment(3, 999));

    let mut broker = Broker::default();
    broker.publish(first.clone(), "first delivery");
    broker.publish(second.clone(), "first delivery");

    while let Some(delivery) = broker.next() {
        handle_and_print(shop, &delivery).await;
        let first_delivery = delivery.why == "first delivery";
        if delivery.msg.order_id == 1 && first_delivery {
            // The consumer crashes after its commit, before the ack: the broker's lock expires and it
            // delivers the message again, with a new delivery tag.
            println!(
                "            consumer crashed before acknowledging; the broker will redeliver"
            );
            broker.publish(delivery.msg, "redelivery after a crash before the ack");
        } else if delivery.msg.order_id == 2 && first_delivery {
            // The acknowledgement is lost; after too many redeliveries the broker dead-letters it.
            println!(
                "            acknowledgement lost; the broker moves the message to its dead-letter queue"
            );
            broker.dead_letters.push(delivery.msg);
        }
    }

    // Two consumers receive copies of the same message at the same moment.
    broker.publish(third.clone(), "two copies at once, to consumer A");
    broker.publish(third, "two copies at once, to consumer B");
    let (a, b) = (broker.next().unwrap(), broker.next().unwrap());
    tokio::join!(handle_and_print(shop, &a), handle_and_print(shop, &b));

    // Days later an operator resubmits everything in the dead-letter queue.
    for msg in std::mem::take(&mut broker.dead_letters) {
        broker.publish(msg, "resubmitted from the dead-letter queue");
    }
    while let Some(delivery) = broker.next() {
        handle_and_print(shop, &delivery).await;
    }

    Ok(shop.state().await?)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .ok()
        .filter(|url| !url.is_empty());
    let state = match url.as_deref() {
        Some(url) if url.starts_with("postgres") => {
            #[cfg(feature = "postgres")]
            {
                println!("running on PostgreSQL");
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(4)
                    .connect(url)
                    .await?;
                simulate(&PostgresShop::open(pool).await?).await?
            }
            #[cfg(not(feature = "postgres"))]
            return Err("a PostgreSQL DATABASE_URL needs `--features postgres`".into());
        }
        Some(url) if url.starts_with("mysql") || url.starts_with("mariadb") => {
            #[cfg(feature = "mysql")]
            {
                println!("running on MySQL");
                let pool = sqlx::mysql::MySqlPoolOptions::new()
                    .max_connections(4)
                    .connect(url)
                    .await?;
                simulate(&MySqlShop::open(pool).await?).await?
            }
            #[cfg(not(feature = "mysql"))]
            return Err("a MySQL DATABASE_URL needs `--features mysql`".into());
        }
        Some(url) => {
            println!("running on {url}");
            simulate(&sqlite_shop(url).await?).await?
        }
        None => {
            let path = std::env::temp_dir().join("idempotent-quickstart.db");
            for suffix in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
            }
            println!("running on SQLite at {}", path.display());
            simulate(&sqlite_shop(&format!("sqlite://{}", path.display())).await?).await?
        }
    };

    println!();
    println!("paid orders:      {:?}", state.paid_orders);
    println!("emails queued:    {} (one per order)", state.emails);
    println!(
        "revenue counted:  {} cents (1250 + 4000 + 999)",
        state.revenue_cents
    );
    println!("inbox rows:       {} (one per message)", state.inbox_rows);
    assert_eq!(state.paid_orders.len(), 3);
    assert_eq!(state.emails, 3);
    assert_eq!(state.revenue_cents, 1250 + 4000 + 999);
    assert_eq!(state.inbox_rows, 3);
    Ok(())
}

async fn sqlite_shop(url: &str) -> Result<SqliteShop, Box<dyn std::error::Error>> {
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(idempotent::sqlite::connect_options(url)?)
        .await?;
    SqliteShop::open(pool).await
}

/// The handler delivered the ways a broker will, with the `testing` kit:
/// `cargo test --example quickstart --features testing`.
#[cfg(all(test, feature = "testing"))]
mod tests {
    use idempotent::Inbox;
    use idempotent::testing::Check;
    use sqlx::Sqlite;

    use super::*;

    #[tokio::test]
    async fn on_payment_received_survives_what_brokers_do() {
        let payment = PaymentReceived {
            message_id: Uuid::now_v7(),
            order_id: 2,
            payment_id: "pay-2".into(),
            amount_cents: 4000,
        };
        let checked = Check::new(
            async || {
                let memory = Inbox::<Sqlite>::in_memory().await?;
                Ok::<_, Box<dyn std::error::Error>>(
                    SqliteShop::open(memory.pool().clone()).await?.inbox,
                )
            },
            async |inbox: &Inbox<Sqlite>| on_sqlite::on_payment_received(inbox, &payment).await,
            async |inbox: &Inbox<Sqlite>| {
                let shop = SqliteShop {
                    inbox: inbox.clone(),
                };
                shop.state().await.unwrap()
            },
        )
        .run()
        .await
        .unwrap_or_else(|divergence| panic!("{divergence}"));
        println!("{checked:?}");
    }
}
