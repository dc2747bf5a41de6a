//! What the broker runners cost, measured in one run on this machine's RabbitMQ, NATS JetStream
//! and (with `kafka`) Kafka, with the `#[idempotent]` handler on PostgreSQL; prints a table of
//! messages per second and ratios. Each figure is the median of `--rounds` rounds (3 by default;
//! the brokers' rounds alternate).
//!
//! ```text
//! cargo bench --bench broker --features rabbitmq,nats,postgres,kafka -- --rounds 5
//! ```
//! (`IDEMPOTENT_PG_URL`, `IDEMPOTENT_AMQP_URL`, `IDEMPOTENT_NATS_URL`: `scripts/postgres start`,
//! `scripts/rabbitmq start` and `scripts/nats start` print them. Kafka is librdkafka's mock
//! cluster in the benchmark's process, or the server at `IDEMPOTENT_KAFKA_URL`.)
//!
//! For each broker, the same messages (a payment to one of 1,000,000 accounts each; on RabbitMQ
//! and Kafka 20% of them published twice, as a retrying producer does, where JetStream drops such
//! copies itself; 5% failing in the handler, which dead-letters them):
//! - **broker**: consumed and acknowledged by a hand-written loop doing no database work: the
//!   broker's own limit on this machine;
//! - **hand-written**: one worker, a loop that calls the handler and acknowledges (dead-letters by
//!   publishing, like the runner);
//! - **runner**: the runner, one worker, one message per transaction;
//! - **runner ×8**: eight workers;
//! - **batches ×8**: eight workers in batch mode, up to 50 messages per transaction.
//!
//! And Kafka's publishing: rdkafka's own producer (`acks=all`, idempotent) against the outbox's
//! Kafka publisher, one message at a time (a relay with one key in flight) and 64 at a time.

#[cfg(feature = "kafka")]
#[path = "broker/kafka.rs"]
mod kafka;

use std::time::{Duration, Instant};

use futures::StreamExt;
use idempotent::broker::nats::async_nats::{self, HeaderMap, jetstream};
use idempotent::broker::rabbitmq::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use idempotent::broker::rabbitmq::lapin::types::FieldTable;
use idempotent::broker::rabbitmq::lapin::{
    BasicProperties, Channel, Connection, ConnectionProperties,
};
use idempotent::broker::{Batches, Message, RunnerStats, Shutdown};
use idempotent::{Error, Handled, Inbox, idempotent};
use rand::Rng;
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool, Postgres};

/// Enough accounts that two batches in flight rarely update the same one: a batch holds each row's
/// lock until it commits, so with few rows, random updates deadlock across batches (PostgreSQL
/// finds it after `deadlock_timeout`, 1 s), which measures the workload, not the runner.
const ACCOUNTS: i64 = 1_000_000;

#[derive(Serialize, Deserialize)]
struct Payment {
    account: i64,
    fail: bool,
}

#[derive(Debug, thiserror::Error)]
enum BenchError {
    #[error("this payment fails on purpose")]
    Failed,
    #[error("not a payment")]
    Decode(#[from] serde_json::Error),
    #[error("database error")]
    Db(#[from] sqlx::Error),
}

struct Incoming {
    message_id: String,
    payment: Payment,
}

#[idempotent(key = "message_id", consumer = "bench")]
async fn pay(tx: &mut PgConnection, msg: &Incoming) -> Result<(), BenchError> {
    if msg.payment.fail {
        return Err(BenchError::Failed);
    }
    sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = $1")
        .bind(msg.payment.account)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

type Outcome = Result<Handled<()>, Error<BenchError>>;

async fn handle(inbox: &Inbox<Postgres>, message_id: String, payload: &[u8]) -> Outcome {
    let payment = serde_json::from_slice(payload).map_err(|e| Error::Handler(e.into()))?;
    pay(
        inbox,
        &Incoming {
            message_id,
            payment,
        },
    )
    .await
}

/// The runner's worker: the handler with a worker's inbox.
fn worker(
    inbox: &Inbox<Postgres>,
) -> impl FnMut(Message) -> futures::future::BoxFuture<'static, Outcome> + Send + use<> {
    let inbox = inbox.for_worker();
    move |message| {
        let inbox = inbox.clone();
        Box::pin(async move { handle(&inbox, message.message_id.0, &message.payload).await })
    }
}

/// The batch body: the same work on the batch's connection.
fn body<'a>(
    tx: &'a mut PgConnection,
    message: &'a Message,
) -> futures::future::BoxFuture<'a, Result<(), BenchError>> {
    Box::pin(async move {
        let payment: Payment = serde_json::from_slice(&message.payload)?;
        if payment.fail {
            return Err(BenchError::Failed);
        }
        sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = $1")
            .bind(payment.account)
            .execute(&mut *tx)
            .await?;
        Ok(())
    })
}

/// The messages of one measurement: (id, payload), with the retried copies.
fn messages(count: usize, copies: bool) -> Vec<(String, Vec<u8>)> {
    let mut rng = rand::rng();
    let mut out = Vec::with_capacity(count + count / 4);
    for _ in 0..count {
        let id = uuid::Uuid::new_v4().to_string();
        let payment = Payment {
            account: rng.random_range(1..=ACCOUNTS),
            fail: rng.random_ratio(1, 20),
        };
        let payload = serde_json::to_vec(&payment).unwrap();
        if copies && rng.random_ratio(1, 5) {
            out.push((id.clone(), payload.clone()));
        }
        out.push((id, payload));
    }
    out
}

async fn reset(pool: &PgPool) {
    for sql in [
        "DROP TABLE IF EXISTS accounts",
        "CREATE TABLE accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL)",
        "INSERT INTO accounts SELECT g, 0 FROM generate_series(1, 1000000) g",
        "TRUNCATE idempotent_inbox",
        "VACUUM ANALYZE",
    ] {
        sqlx::query(sql).execute(pool).await.unwrap();
    }
}

fn rate(count: usize, elapsed: Duration) -> f64 {
    count as f64 / elapsed.as_secs_f64()
}

/// Runs `run` until `done` says every message was settled, then cancels it; messages per second.
async fn measure<F>(count: usize, run: F, settled: impl Fn() -> usize, shutdown: Shutdown) -> f64
where
    F: std::future::Future + Send + 'static,
    F::Output: Send,
{
    let start = Instant::now();
    let task = tokio::spawn(run);
    while settled() < count {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = start.elapsed();
    shutdown.cancel();
    let _ = task.await;
    rate(count, elapsed)
}

/// What the runner counted, for the record.
fn counted(stats: &RunnerStats) -> String {
    format!(
        "{} processed, {} duplicates, {} retried, {} dead-lettered",
        stats.processed, stats.duplicates, stats.retried, stats.dead_lettered
    )
}

fn total(stats: &RunnerStats) -> usize {
    (stats.processed + stats.duplicates + stats.retried + stats.dead_lettered) as usize
}

// ---------------------------------------------------------------------------------------------
// RabbitMQ

async fn amqp() -> (Connection, Channel) {
    let url = std::env::var("IDEMPOTENT_AMQP_URL").expect("IDEMPOTENT_AMQP_URL");
    let connection = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    (connection, channel)
}

async fn fill_queue(channel: &Channel, messages: &[(String, Vec<u8>)]) -> String {
    let queue = format!("bench-{}", uuid::Uuid::new_v4().simple());
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut confirms = Vec::with_capacity(messages.len());
    for (id, payload) in messages {
        let properties = BasicProperties::default()
            .with_message_id(id.as_str().into())
            .with_delivery_mode(2);
        confirms.push(
            channel
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    payload,
                    properties,
                )
                .await
                .unwrap(),
        );
    }
    for confirm in confirms {
        confirm.await.unwrap();
    }
    queue
}

async fn rabbitmq(
    pool: &PgPool,
    inbox: &Inbox<Postgres>,
    count: usize,
) -> Vec<(&'static str, f64)> {
    eprintln!("RabbitMQ, {count} messages:");
    let mut rows = Vec::new();
    let (_connection, channel) = amqp().await;

    // The broker's limit: consume and ack, nothing else.
    let batch = messages(count, true);
    let queue = fill_queue(&channel, &batch).await;
    let (_c, consuming) = amqp().await;
    consuming
        .basic_qos(64, BasicQosOptions::default())
        .await
        .unwrap();
    let mut deliveries = consuming
        .basic_consume(
            queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let start = Instant::now();
    for _ in 0..batch.len() {
        let delivery = deliveries.next().await.unwrap().unwrap();
        delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    record(
        &mut rows,
        "broker, no database",
        rate(batch.len(), start.elapsed()),
    );

    // A hand-written loop with the handler, one worker.
    reset(pool).await;
    let batch = messages(count, true);
    let queue = fill_queue(&channel, &batch).await;
    let dead = format!("{queue}.dead");
    channel
        .queue_declare(
            dead.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let (_c, consuming) = amqp().await;
    consuming
        .basic_qos(1, BasicQosOptions::default())
        .await
        .unwrap();
    consuming
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let mut deliveries = consuming
        .basic_consume(
            queue.as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let worker_inbox = inbox.for_worker();
    let start = Instant::now();
    for _ in 0..batch.len() {
        let delivery = deliveries.next().await.unwrap().unwrap();
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .unwrap()
            .to_string();
        match handle(&worker_inbox, id, &delivery.data).await {
            Ok(_) => {}
            Err(_) => {
                consuming
                    .basic_publish(
                        "".into(),
                        dead.as_str().into(),
                        BasicPublishOptions::default(),
                        &delivery.data,
                        delivery.properties.clone(),
                    )
                    .await
                    .unwrap()
                    .await
                    .unwrap();
            }
        }
        delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    record(
        &mut rows,
        "hand-written loop, 1 worker",
        rate(batch.len(), start.elapsed()),
    );

    for (label, workers, batches) in runner_cases() {
        reset(pool).await;
        let batch = messages(count, true);
        let queue = fill_queue(&channel, &batch).await;
        let (_c, consuming) = amqp().await;
        let shutdown = Shutdown::new();
        let runner = idempotent::broker::rabbitmq::Runner::new(consuming, &queue)
            .workers(workers)
            .shutdown_on(shutdown.clone());
        let stats = std::sync::Arc::new(runner.stats());
        let inbox = inbox.clone();
        let counting = stats.clone();
        let per_second = match batches {
            None => {
                let run = runner.run(move || worker(&inbox));
                measure(batch.len(), run, move || total(&counting()), shutdown).await
            }
            Some(batches) => {
                let run = runner.run_batches(inbox, "bench", batches, || body);
                measure(batch.len(), run, move || total(&counting()), shutdown).await
            }
        };
        eprintln!("  {label}: {}", counted(&stats()));
        record(&mut rows, label, per_second);
    }
    rows
}

// ---------------------------------------------------------------------------------------------
// NATS JetStream

async fn nats_stream(
    messages: &[(String, Vec<u8>)],
) -> (
    jetstream::Context,
    jetstream::consumer::PullConsumer,
    String,
) {
    let url = std::env::var("IDEMPOTENT_NATS_URL").expect("IDEMPOTENT_NATS_URL");
    let jetstream = jetstream::new(async_nats::connect(url).await.unwrap());
    let name = format!("B_{}", uuid::Uuid::new_v4().simple());
    let stream = jetstream
        .create_stream(jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.in"), format!("{name}.dead")],
            ..Default::default()
        })
        .await
        .unwrap();
    // A thousand publications in flight at a time: async-nats holds back a publish while too many
    // acknowledgements are awaited (somewhere between 3,000 and 10,000), which would wait for ever
    // for acknowledgements awaited only after the last publish.
    for group in messages.chunks(1000) {
        let mut acks = Vec::with_capacity(group.len());
        for (id, payload) in group {
            let mut headers = HeaderMap::new();
            headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
            acks.push(
                jetstream
                    .publish_with_headers(format!("{name}.in"), headers, payload.clone().into())
                    .await
                    .unwrap(),
            );
        }
        for ack in acks {
            ack.await.unwrap();
        }
    }
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("bench".into()),
            filter_subject: format!("{name}.in"),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .unwrap();
    (jetstream, consumer, format!("{name}.dead"))
}

async fn nats(pool: &PgPool, inbox: &Inbox<Postgres>, count: usize) -> Vec<(&'static str, f64)> {
    eprintln!("NATS JetStream, {count} messages:");
    let mut rows = Vec::new();

    let batch = messages(count, false);
    let (_, consumer, _) = nats_stream(&batch).await;
    let mut pulled = consumer
        .stream()
        .max_messages_per_batch(64)
        .messages()
        .await
        .unwrap();
    let start = Instant::now();
    for _ in 0..batch.len() {
        pulled
            .next()
            .await
            .unwrap()
            .unwrap()
            .double_ack()
            .await
            .unwrap();
    }
    record(
        &mut rows,
        "broker, no database",
        rate(batch.len(), start.elapsed()),
    );

    reset(pool).await;
    let batch = messages(count, false);
    let (jetstream, consumer, dead) = nats_stream(&batch).await;
    // What a hand-written consumer writes: async-nats's default pull stream (200 at a time).
    let mut pulled = consumer.messages().await.unwrap();
    let worker_inbox = inbox.for_worker();
    let start = Instant::now();
    for _ in 0..batch.len() {
        let message = pulled.next().await.unwrap().unwrap();
        let id = message
            .headers
            .as_ref()
            .unwrap()
            .get(async_nats::header::NATS_MESSAGE_ID)
            .unwrap()
            .to_string();
        if handle(&worker_inbox, id, &message.payload).await.is_err() {
            jetstream
                .publish(dead.clone(), message.payload.clone())
                .await
                .unwrap()
                .await
                .unwrap();
            message.ack_with(jetstream::AckKind::Term).await.unwrap();
        } else {
            message.double_ack().await.unwrap();
        }
    }
    record(
        &mut rows,
        "hand-written loop, 1 worker",
        rate(batch.len(), start.elapsed()),
    );

    for (label, workers, batches) in runner_cases() {
        reset(pool).await;
        let batch = messages(count, false);
        let (jetstream, consumer, dead) = nats_stream(&batch).await;
        let shutdown = Shutdown::new();
        let runner = idempotent::broker::nats::Runner::new(jetstream, consumer, dead)
            .workers(workers)
            .shutdown_on(shutdown.clone());
        let stats = std::sync::Arc::new(runner.stats());
        let inbox = inbox.clone();
        let counting = stats.clone();
        let per_second = match batches {
            None => {
                let run = runner.run(move || worker(&inbox));
                measure(batch.len(), run, move || total(&counting()), shutdown).await
            }
            Some(batches) => {
                let run = runner.run_batches(inbox, "bench", batches, || body);
                measure(batch.len(), run, move || total(&counting()), shutdown).await
            }
        };
        eprintln!("  {label}: {}", counted(&stats()));
        record(&mut rows, label, per_second);
    }
    rows
}

/// The runner's measurements, the same on each broker: a label, the workers, batch mode or not.
fn runner_cases() -> [(&'static str, usize, Option<Batches>); 3] {
    [
        ("runner, 1 worker", 1, None),
        ("runner, 8 workers", 8, None),
        (
            "batches of 50, 8 workers",
            8,
            Some(Batches::new(50, Duration::from_millis(5))),
        ),
    ]
}

/// Each measurement's median over the rounds.
fn medians(rounds: &[Vec<(&'static str, f64)>]) -> Vec<(&'static str, f64)> {
    (0..rounds[0].len())
        .map(|i| {
            let mut rates: Vec<f64> = rounds.iter().map(|round| round[i].1).collect();
            rates.sort_by(f64::total_cmp);
            (rounds[0][i].0, rates[rates.len() / 2])
        })
        .collect()
}

/// Adds a measurement to `rows`, and says so on stderr (a run takes minutes).
fn record(rows: &mut Vec<(&'static str, f64)>, label: &'static str, per_second: f64) {
    eprintln!("  {label}: {per_second:.0} msg/s");
    rows.push((label, per_second));
}

fn arg(name: &str, default: usize) -> usize {
    std::env::args()
        .skip_while(|a| a != name)
        .nth(1)
        .map_or(default, |n| n.parse().expect("a number"))
}

#[tokio::main]
async fn main() {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs a benchmark without it, and
    // then it measures nothing.
    if !std::env::args().any(|arg| arg == "--bench") {
        return;
    }
    let count = arg("--messages", 3000);
    let rounds = arg("--rounds", 3).max(1);
    let url = std::env::var("IDEMPOTENT_PG_URL").expect("IDEMPOTENT_PG_URL");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(12)
        .connect(&url)
        .await
        .unwrap();
    let inbox = Inbox::new(pool.clone());
    inbox.migrate().await.unwrap();
    // The brokers' rounds alternate, so that a slow spell of the machine does not hit one broker's
    // every round.
    let (mut amqp, mut jetstream) = (Vec::new(), Vec::new());
    #[cfg(feature = "kafka")]
    let (cluster, mut kafka_consumers, mut kafka_publishers) =
        (kafka::Kafka::start().await, Vec::new(), Vec::new());
    for _ in 0..rounds {
        amqp.push(rabbitmq(&pool, &inbox, count).await);
        jetstream.push(nats(&pool, &inbox, count).await);
        #[cfg(feature = "kafka")]
        {
            kafka_consumers.push(kafka::consume(&cluster, &pool, &inbox, count).await);
            kafka_publishers.push(kafka::publish(&cluster, count).await);
        }
    }
    let heading = |broker: &str, copies: bool| {
        format!(
            "{broker}, {count} messages (5% failing{}), PostgreSQL, medians of {rounds} rounds:",
            if copies { ", 20% published twice" } else { "" }
        )
    };
    print_consumers(&heading("RabbitMQ", true), &medians(&amqp));
    print_consumers(&heading("NATS JetStream", false), &medians(&jetstream));
    #[cfg(feature = "kafka")]
    {
        print_consumers(
            &heading(&format!("Kafka on {}", cluster.name()), true),
            &medians(&kafka_consumers),
        );
        let rows = medians(&kafka_publishers);
        println!("\nKafka publishing, {count} messages, medians of {rounds} rounds:");
        println!("| measurement | msg/s | vs rdkafka's producer |");
        println!("|---|---|---|");
        for (i, (label, per_second)) in rows.iter().enumerate() {
            // Rows alternate: rdkafka's producer, then the publisher, at each concurrency.
            let baseline = rows[i - i % 2].1;
            println!(
                "| {label} | {per_second:.0} | {:.2} |",
                per_second / baseline
            );
        }
    }
}

/// One broker's table: the rows of `rabbitmq()`, `nats()` or `kafka::consume()`, in that order.
fn print_consumers(heading: &str, rows: &[(&'static str, f64)]) {
    println!("\n{heading}");
    println!("| measurement | msg/s | vs hand-written | vs broker |");
    println!("|---|---|---|---|");
    let broker_rate = rows[0].1;
    let hand = rows[1].1;
    for (label, per_second) in rows {
        println!(
            "| {label} | {per_second:.0} | {:.2} | {:.2} |",
            per_second / hand,
            per_second / broker_rate
        );
    }
    let runner_one = rows[2].1;
    println!(
        "runner cost against the hand-written loop: {:.1}%",
        (1.0 - runner_one / hand) * 100.0
    );
    println!(
        "batches of 50 against the runner's one-message mode, 8 workers each: {:.2}x",
        rows[4].1 / rows[3].1
    );
}
