//! The outbox's publishers against the real brokers (`IDEMPOTENT_AMQP_URL`, `IDEMPOTENT_NATS_URL`,
//! started by `scripts/test`): a handler queues its follow-up messages in its outbox, and a relay
//! publishes them ([`delivery`]: each message persistent and confirmed, with the outbox's id as the
//! broker's message id, and each second publication a duplicate downstream); one bad destination
//! stays its own trouble ([`one_bad_thing`]: a missing exchange, a subject without a stream, a
//! full queue or stream are parked with the broker's reason while the other rows go out); a
//! memory alarm on RabbitMQ holds the relay without losing or doubling rows ([`alarm`]).
#![cfg(all(feature = "rabbitmq", feature = "nats", feature = "sqlite"))]

mod alarm;
mod delivery;
#[path = "../support/forging.rs"]
#[allow(dead_code)]
mod forging;
mod one_bad_thing;

/// Held for reading by each case on RabbitMQ, and for writing by a case that raises a memory
/// alarm, which blocks every connection of the broker that publishes: no other case runs under it.
static ALARM: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use idempotent::outbox::{Destination, Outbox, OutgoingMessage, RelayOptions};
use idempotent::{Inbox, idempotent};
use sqlx::{Sqlite, SqliteConnection, SqlitePool};

struct Order {
    order_id: String,
    destination: Destination,
}

/// The producer's handler: records the order and queues its follow-up message.
#[idempotent(key = "order_id", consumer = "orders")]
async fn on_order(
    tx: &mut SqliteConnection,
    msg: &Order,
    outbox: &mut Outbox,
) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO orders (id) VALUES ($1)")
        .bind(&msg.order_id)
        .execute(&mut *tx)
        .await?;
    let paid = OutgoingMessage::new(msg.destination.clone(), msg.order_id.clone().into_bytes())
        .with_header("order-id", msg.order_id.clone());
    outbox.send(paid);
    Ok(())
}

/// What the downstream consumer is handed.
struct Incoming {
    message_id: String,
    payload: Vec<u8>,
}

/// The downstream consumer: keyed on the broker's message id, as any consumer of these events is.
#[idempotent(key = "message_id", consumer = "downstream")]
async fn downstream(tx: &mut SqliteConnection, msg: &Incoming) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO received (message_id, payload) VALUES ($1, $2)")
        .bind(&msg.message_id)
        .bind(&msg.payload)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// A producer's database with its outbox, and a downstream database with its inbox.
struct Two {
    producer: Inbox<Sqlite>,
    downstream: Inbox<Sqlite>,
    _dir: tempfile::TempDir,
}

impl Two {
    async fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let open = async |name: &str, table: &str| {
            let url = format!("sqlite://{}", dir.path().join(name).display());
            let pool = SqlitePool::connect_with(idempotent::sqlite::connect_options(&url).unwrap())
                .await
                .unwrap();
            sqlx::query(sqlx::AssertSqlSafe(table))
                .execute(&pool)
                .await
                .unwrap();
            let inbox = Inbox::new(pool);
            inbox.migrate().await.unwrap();
            inbox
        };
        Self {
            producer: open("producer.db", "CREATE TABLE orders (id TEXT PRIMARY KEY)").await,
            downstream: open(
                "downstream.db",
                "CREATE TABLE received (message_id TEXT NOT NULL, payload BLOB NOT NULL)",
            )
            .await,
            _dir: dir,
        }
    }

    /// Handles `count` orders, each queueing a message to `destination`; returns their ids.
    async fn orders(&self, prefix: &str, count: usize, destination: &Destination) -> Vec<String> {
        let mut ids = Vec::new();
        for i in 0..count {
            let order = Order {
                order_id: format!("{prefix}-{i}"),
                destination: destination.clone(),
            };
            assert!(
                on_order(&self.producer, &order)
                    .await
                    .unwrap()
                    .is_processed()
            );
            let key = idempotent::message_key(&order.order_id).unwrap();
            ids.push(Outbox::derived_id("orders", &key, 0));
        }
        ids
    }

    /// Waits until the outbox has `sent` sent and `parked` parked messages and none pending.
    async fn until_published(&self, sent: u64, parked: u64) {
        let start = Instant::now();
        loop {
            let stats = self.producer.outbox_stats().await.unwrap();
            if (stats.pending, stats.sent, stats.parked) == (0, sent, parked) {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "not published in time: {stats:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Makes every sent row pending again: what a relay that died after the broker's confirmation
    /// and before its commit leaves behind.
    async fn as_if_never_marked(&self) -> u64 {
        sqlx::query("UPDATE idempotent_inbox_outbox SET state = 0 WHERE state = 1")
            .execute(self.producer.pool())
            .await
            .unwrap()
            .rows_affected()
    }

    /// How many times each message's effect was committed downstream.
    async fn received(&self) -> HashMap<String, i64> {
        sqlx::query_as::<_, (String, i64)>(
            "SELECT message_id, COUNT(*) FROM received GROUP BY message_id",
        )
        .fetch_all(self.downstream.pool())
        .await
        .unwrap()
        .into_iter()
        .collect()
    }
}

fn options() -> RelayOptions {
    RelayOptions::default()
        .batch_size(8)
        .attempts(2, Duration::from_millis(50))
        .poll_interval(Duration::from_millis(5), Duration::from_millis(50))
}

fn amqp_url() -> String {
    std::env::var("IDEMPOTENT_AMQP_URL")
        .expect("IDEMPOTENT_AMQP_URL is not set: run the tests with scripts/test")
}

/// A channel of the test's own (in publisher-confirm mode) and a fresh durable queue on it,
/// declared with `arguments`.
async fn rabbitmq_queue(arguments: lapin::types::FieldTable) -> (lapin::Channel, String) {
    use lapin::options::{ConfirmSelectOptions, QueueDeclareOptions};
    use lapin::{Connection, ConnectionProperties};
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let queue = format!("outbox-{}", uuid::Uuid::new_v4().simple());
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            arguments,
        )
        .await
        .unwrap();
    // The channel keeps its connection open for as long as the test holds the channel.
    std::mem::forget(connection);
    (channel, queue)
}

/// Takes every message off `queue`: their message ids, in the order they came.
async fn rabbitmq_ids(channel: &lapin::Channel, queue: &str) -> Vec<String> {
    use lapin::options::BasicGetOptions;
    let mut ids = Vec::new();
    while let Some(delivery) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        ids.push(
            delivery
                .properties
                .message_id()
                .as_ref()
                .unwrap()
                .to_string(),
        );
    }
    ids
}

/// Asserts that `got` holds each of `expected` at least once, and nothing else; returns how many
/// copies it holds beyond one of each.
fn each_at_least_once(got: &[String], expected: &[String]) -> usize {
    let unique: HashSet<&String> = got.iter().collect();
    let wanted: HashSet<&String> = expected.iter().collect();
    assert_eq!(
        unique.len(),
        wanted.len(),
        "{} of {} messages arrived",
        unique.intersection(&wanted).count(),
        wanted.len()
    );
    assert_eq!(unique, wanted, "other messages arrived");
    got.len() - unique.len()
}

/// Runs `rabbitmqctl` on the test broker's node (`IDEMPOTENT_AMQP_CTL`, which `scripts/rabbitmq
/// start` prints); returns what it printed.
fn rabbitmqctl(args: &str) -> String {
    try_rabbitmqctl(args).unwrap_or_else(|error| panic!("{error}"))
}

/// [`rabbitmqctl`] for a `Drop` (a panic there, while a failed test unwinds, would abort the run):
/// says what failed instead of panicking.
fn try_rabbitmqctl(args: &str) -> Result<String, String> {
    let ctl = std::env::var("IDEMPOTENT_AMQP_CTL").map_err(|_| {
        "IDEMPOTENT_AMQP_CTL is not set: run the tests with scripts/test".to_owned()
    })?;
    let output = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{ctl} ctl {args}"))
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|error| format!("rabbitmqctl {args}: {error}"))?;
    match output.status.success() {
        true => Ok(String::from_utf8_lossy(&output.stdout).into_owned()),
        false => Err(format!("rabbitmqctl {args}: {}", output.status)),
    }
}
