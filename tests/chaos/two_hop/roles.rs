//! The processes of the two-hop run, each a copy of the test binary started by the driver:
//! consumer A (an inbox and an outbox on PostgreSQL, fed by RabbitMQ), the relays (A's outbox to
//! RabbitMQ, or to Kafka with `CHAOS_KAFKA`), and consumer B (an inbox on PostgreSQL, fed by the
//! relays' queue, or by their topic through the Kafka runner: `kafka.rs`). Each stops at its crash
//! points when the dice say so, prints `PAUSED <role> <point>`, and waits to be SIGKILLed.

use std::io::Write;
use std::sync::Mutex;
use std::time::Duration;

use futures::StreamExt;
use idempotent::broker::rabbitmq::OutboxPublisher;
use idempotent::outbox::{
    Destination, Outbox, OutgoingMessage, Publication, PublishError, Publisher, RelayOptions,
};
use idempotent::{Error, Handled, Inbox, idempotent};
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool, Postgres};

/// What the driver publishes to A, and what A's outgoing message carries to B.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Payload {
    /// The ordering key: an order.
    pub key: String,
    /// In B's payload: the number A's commit gave this message among its key's (A's commit order).
    pub n: i64,
}

/// Where a process stops to be killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    BeforeHandle,
    InBody,
    AfterCommit,
    BeforePublish,
    AfterConfirm,
}

impl Point {
    pub fn name(self) -> &'static str {
        match self {
            Point::BeforeHandle => "before-handle",
            Point::InBody => "in-body",
            Point::AfterCommit => "after-commit-before-ack",
            Point::BeforePublish => "before-publish",
            Point::AfterConfirm => "after-confirm-before-mark",
        }
    }
}

/// Prints one line and flushes it, so that the driver sees it before anything else happens.
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Stops here for good: tells the driver, which kills the process.
async fn pause(role: &str, point: Point) -> ! {
    say(&format!("PAUSED {role} {}", point.name()));
    std::future::pending::<()>().await;
    unreachable!()
}

/// The handlers' error.
#[derive(Debug, thiserror::Error)]
pub enum ChaosError {
    #[error("database error in the handler")]
    Db(#[from] sqlx::Error),
    #[error("not a payload")]
    Decode(#[from] serde_json::Error),
}

/// A delivery as A's and B's handlers take it.
pub struct Incoming {
    pub message_id: String,
    pub payload: Payload,
    /// Where this delivery's process stops, if it does.
    pub crash: Option<Point>,
    pub role: &'static str,
}

impl Incoming {
    pub async fn crash_at(&self, point: Point) {
        if self.crash == Some(point) {
            pause(self.role, point).await;
        }
    }
}

/// A: counts the message in its key (the number follows A's commits of the key: the key's row is
/// locked until the commit) and queues the follow-up for B with the key as its ordering key.
#[idempotent(key = "message_id", consumer = "a")]
async fn hop_a(
    tx: &mut PgConnection,
    msg: &Incoming,
    outbox: &mut Outbox,
) -> Result<(), ChaosError> {
    let n: i64 = sqlx::query_scalar(
        "INSERT INTO a_keys (key, n) VALUES ($1, 1)
         ON CONFLICT (key) DO UPDATE SET n = a_keys.n + 1 RETURNING n",
    )
    .bind(&msg.payload.key)
    .fetch_one(&mut *tx)
    .await?;
    sqlx::query("INSERT INTO a_effects (message_id, key, n) VALUES ($1, $2, $3)")
        .bind(&msg.message_id)
        .bind(&msg.payload.key)
        .bind(n)
        .execute(&mut *tx)
        .await?;
    msg.crash_at(Point::InBody).await;
    let onward = Payload {
        key: msg.payload.key.clone(),
        n,
    };
    let destination = Destination::queue(std::env::var("CHAOS_B_QUEUE").expect("set"));
    outbox.send(
        OutgoingMessage::new(destination, serde_json::to_vec(&onward)?)
            .with_ordering_key(msg.payload.key.clone())
            .with_header("source", msg.message_id.clone()),
    );
    Ok(())
}

/// B: records the message with its own count of its key's messages (B's processing order).
#[idempotent(key = "message_id", consumer = "b")]
async fn hop_b(tx: &mut PgConnection, msg: &Incoming) -> Result<(), ChaosError> {
    let b_seq: i64 = sqlx::query_scalar(
        "INSERT INTO b_keys (key, n) VALUES ($1, 1)
         ON CONFLICT (key) DO UPDATE SET n = b_keys.n + 1 RETURNING n",
    )
    .bind(&msg.payload.key)
    .fetch_one(&mut *tx)
    .await?;
    sqlx::query("INSERT INTO b_effects (message_id, key, n, b_seq) VALUES ($1, $2, $3, $4)")
        .bind(&msg.message_id)
        .bind(&msg.payload.key)
        .bind(msg.payload.n)
        .bind(b_seq)
        .execute(&mut *tx)
        .await?;
    msg.crash_at(Point::InBody).await;
    Ok(())
}

/// A pool on the run's database that waits out a PostgreSQL restart.
pub fn pool(url: &str) -> PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(3))
        .connect_lazy(url)
        .expect("a PostgreSQL URL")
}

/// Where the dice stop this delivery's process, if they do.
pub fn roll(dice: &Mutex<StdRng>, rate: f64) -> Option<Point> {
    let mut dice = dice.lock().unwrap();
    dice.random_bool(rate)
        .then(|| [Point::BeforeHandle, Point::InBody, Point::AfterCommit][dice.random_range(0..3)])
}

/// Handles a delivery at A or B until it commits, retrying what is retryable in place (so that B's
/// order is not changed by a retry), stopping at the delivery's crash point on the way; after it
/// the delivery may be acknowledged.
pub async fn settle(inbox: &Inbox<Postgres>, incoming: &Incoming) -> Handled<()> {
    incoming.crash_at(Point::BeforeHandle).await;
    let mut pause = Duration::from_millis(20);
    let handled = loop {
        let outcome: Result<Handled<()>, Error<ChaosError>> = if incoming.role == "a" {
            hop_a(inbox, incoming).await
        } else {
            hop_b(inbox, incoming).await
        };
        match outcome {
            Ok(handled) => break handled,
            Err(error) if error.is_retryable() => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            Err(error) => {
                eprintln!("consumer {}: not retryable: {error:?}", incoming.role);
                say(&format!("FAILED {} {}", incoming.role, incoming.message_id));
                std::future::pending::<()>().await;
            }
        }
    };
    incoming.crash_at(Point::AfterCommit).await;
    handled
}

/// A consumer process: `role` is `a` or `b`. Consumes its queue (A with `prefetch` deliveries at
/// once, B one at a time so that its processing follows the queue's order), settles each
/// delivery, then acknowledges it. B with `CHAOS_KAFKA` (the cluster's servers) is the Kafka
/// runner on the topic `queue`.
pub async fn consume(role: &'static str, pg: &str, amqp: &str, queue: &str, rate: f64, seed: u64) {
    #[cfg(feature = "kafka")]
    if role == "b"
        && let Ok(servers) = std::env::var("CHAOS_KAFKA")
    {
        return crate::kafka::consume_b(pg, &servers, queue, rate, seed).await;
    }
    let inbox = Inbox::<Postgres>::new(pool(pg));
    let inbox = if role == "b" {
        inbox.with_table("b_inbox").expect("a table name")
    } else {
        inbox
    };
    let connection = Connection::connect(amqp, ConnectionProperties::default())
        .await
        .expect("RabbitMQ");
    let channel = connection.create_channel().await.expect("a channel");
    let prefetch = if role == "a" { 3 } else { 1 };
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await
        .expect("qos");
    let mut consumer = channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consume");
    let dice = std::sync::Arc::new(Mutex::new(StdRng::seed_from_u64(
        seed ^ u64::from(std::process::id()),
    )));
    let mut running = tokio::task::JoinSet::new();
    while let Some(delivery) = consumer.next().await {
        let delivery = delivery.expect("a delivery");
        let inbox = inbox.clone();
        let dice = dice.clone();
        let work = async move {
            let crash = roll(&dice, rate);
            let message_id = delivery
                .properties
                .message_id()
                .as_ref()
                .expect("a message id")
                .to_string();
            let payload: Payload = serde_json::from_slice(&delivery.data).expect("a payload");
            let incoming = Incoming {
                message_id,
                payload,
                crash,
                role,
            };
            let handled = settle(&inbox, &incoming).await;
            delivery
                .ack(BasicAckOptions::default())
                .await
                .expect("an ack");
            let what = if handled.is_duplicate() {
                "duplicate"
            } else {
                "processed"
            };
            say(&format!(
                "{} {} {what}",
                role.to_uppercase(),
                incoming.message_id
            ));
        };
        if prefetch == 1 {
            work.await;
        } else {
            running.spawn(work);
            while running.len() >= usize::from(prefetch) {
                running.join_next().await;
            }
        }
    }
}

/// A broker client that stops its process before a publication, or after the broker confirmed it
/// and before the relay could mark it sent, when the dice say so.
struct Killing<P> {
    inner: P,
    rate: f64,
    dice: Mutex<StdRng>,
}

impl<P: Publisher> Publisher for Killing<P> {
    async fn publish(&self, publication: &Publication) -> Result<(), PublishError> {
        let (before, after) = {
            let mut dice = self.dice.lock().unwrap();
            (
                dice.random_bool(self.rate / 2.0),
                dice.random_bool(self.rate / 2.0),
            )
        };
        if before {
            pause("relay", Point::BeforePublish).await;
        }
        self.inner.publish(publication).await?;
        if after {
            pause("relay", Point::AfterConfirm).await;
        }
        Ok(())
    }
}

/// A relay process: A's outbox to RabbitMQ (or to Kafka, with `CHAOS_KAFKA`), until the driver
/// kills it or closes its stdin.
pub async fn relay(pg: &str, amqp: &str, rate: f64, seed: u64) {
    #[cfg(feature = "kafka")]
    if let Ok(servers) = std::env::var("CHAOS_KAFKA") {
        return run_relay(pg, crate::kafka::publisher(&servers), rate, seed).await;
    }
    let publisher = loop {
        match OutboxPublisher::connect(amqp).await {
            Ok(publisher) => break publisher,
            Err(error) => {
                eprintln!("relay: {error}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    run_relay(pg, publisher, rate, seed).await;
}

async fn run_relay(pg: &str, publisher: impl Publisher + 'static, rate: f64, seed: u64) {
    let inbox = Inbox::<Postgres>::new(pool(pg));
    let killing = Killing {
        inner: publisher,
        rate,
        dice: Mutex::new(StdRng::seed_from_u64(seed ^ u64::from(std::process::id()))),
    };
    let options = RelayOptions::default()
        .batch_size(25)
        .poll_interval(Duration::from_millis(5), Duration::from_millis(200));
    let relay = inbox.spawn_relay(killing, options);
    // Until the driver closes our stdin.
    let mut stdin = tokio::io::BufReader::new(tokio::io::stdin());
    let mut line = String::new();
    let _ = tokio::io::AsyncBufReadExt::read_line(&mut stdin, &mut line).await;
    relay.shutdown().await;
}
