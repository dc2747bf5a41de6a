//! What the outbox costs and how fast its relay goes, measured in one run on this machine's
//! PostgreSQL, RabbitMQ and NATS JetStream; prints tables and writes `docs/bench_outbox.svg`.
//!
//! ```text
//! cargo bench --bench outbox --features rabbitmq,nats,postgres
//! ```
//! (`IDEMPOTENT_PG_URL`, `IDEMPOTENT_AMQP_URL`, `IDEMPOTENT_NATS_URL`.)
//!
//! 1. **Relay throughput** against the broker's own limit: the broker's publish-with-confirm rate
//!    (a hand-written loop on one channel or context, persistent messages with ids, up to 1,000
//!    unconfirmed at once: the best this machine's broker does), then a relay draining the same
//!    number of committed outgoing rows through the outbox's publisher, by batch size and workers;
//!    and the keyed drain (section `keyed`): rows without an ordering key against rows on 50 keys,
//!    at 1 and 4 workers, as ratios to each other and to the broker's own loop.
//! 2. **Commit-to-publish latency**: handlers commit one outgoing message each at a steady rate
//!    (one worker at 100/s, eight at 1,000/s); from each commit's return to the broker's
//!    confirmation of its message, p50 and p99, with the relay woken by `LISTEN/NOTIFY` and with
//!    polling only.
//! 3. **Handler cost**: the same handler (one `UPDATE`) with and without queueing one outgoing
//!    message, 8 workers, as a ratio: the relays woken after the commit (the default), by a
//!    `NOTIFY` in the transaction (as before), and not at all (relays that poll).
//!
//! 4. **Tenants** (section `tenants`): one relay over 100 tenants' outboxes against one outbox.
//! 5. **Backlogs** (section `backlog`): 20,000 rows drained off backlogs of 20,000 and 200,000, without
//!    an ordering key and on 50 keys, on SQLite, PostgreSQL and (with `--features mysql` and
//!    `IDEMPOTENT_MYSQL_URL`) MariaDB: whether finding the keys' heads slows as a backlog grows.
//!
//! Sections by name: `cargo bench --bench outbox --features rabbitmq,nats,postgres -- latency cost`
//! (`throughput` includes `keyed`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use idempotent::broker::nats::async_nats::{self, HeaderMap, jetstream};
use idempotent::broker::rabbitmq::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueuePurgeOptions,
};
use idempotent::broker::rabbitmq::lapin::types::FieldTable;
use idempotent::broker::rabbitmq::lapin::{
    BasicProperties, Channel, Connection, ConnectionProperties,
};
use idempotent::outbox::{
    Destination, Outbox, OutgoingMessage, Publication, PublishError, Publisher, RelayOptions,
};
use idempotent::{Backend, Inbox, Tenants, idempotent};
use sqlx::{PgConnection, PgPool, Postgres};

const ACCOUNTS: i64 = 10_000;
/// Unconfirmed messages the broker's own loop keeps in flight.
const WINDOW: usize = 1000;

fn payload(i: usize) -> Vec<u8> {
    format!(r#"{{"event":"order.paid","order":{i},"amount_cents":4200,"currency":"EUR"}}"#)
        .into_bytes()
}

fn rate(count: usize, elapsed: Duration) -> f64 {
    count as f64 / elapsed.as_secs_f64()
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"))
}

// ---------------------------------------------------------------------------------------------
// The database

async fn reset(pool: &PgPool) {
    for sql in [
        "DROP TABLE IF EXISTS accounts",
        "CREATE TABLE accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL)",
        "INSERT INTO accounts SELECT g, 0 FROM generate_series(1, 10000) g",
        "TRUNCATE idempotent_inbox, idempotent_inbox_outbox, idempotent_inbox_outbox_keys",
        "VACUUM ANALYZE",
    ] {
        sqlx::query(sql).execute(pool).await.unwrap();
    }
}

/// Commits `count` outgoing messages to `destination`, 500 per transaction.
async fn fill_outbox(inbox: &Inbox<Postgres>, count: usize, destination: &Destination) {
    fill_keyed_outbox(inbox, count, destination, 0).await;
}

/// Commits `count` outgoing messages to `destination`, 500 per transaction, message `i` with the
/// ordering key `key-{i % keys}` (none when `keys` is 0).
async fn fill_keyed_outbox<DB: Backend>(
    inbox: &Inbox<DB>,
    count: usize,
    destination: &Destination,
    keys: usize,
) {
    let run = uuid::Uuid::new_v4().simple().to_string();
    for chunk in (0..count).collect::<Vec<_>>().chunks(500) {
        let mut outbox = Outbox::new("bench", &format!("{run}-{}", chunk[0])).unwrap();
        for i in chunk {
            let message = OutgoingMessage::new(destination.clone(), payload(*i));
            outbox.send(if keys == 0 {
                message
            } else {
                message.with_ordering_key(format!("key-{}", i % keys))
            });
        }
        let mut tx = inbox.pool().begin().await.unwrap();
        inbox.enqueue(&mut tx, outbox).await.unwrap();
        tx.commit().await.unwrap();
    }
}

/// Runs a relay with `options` until it published `count` messages; messages per second.
async fn drain<DB: Backend, P: Publisher>(
    inbox: &Inbox<DB>,
    publisher: P,
    options: RelayOptions,
    count: usize,
) -> f64 {
    drain_with(|| inbox.spawn_relay(publisher, options), count).await
}

/// Runs the relay `spawn` starts until it published `count` messages; messages per second.
async fn drain_with(spawn: impl FnOnce() -> idempotent::outbox::Relay, count: usize) -> f64 {
    let start = Instant::now();
    let relay = spawn();
    while (relay.stats().published as usize) < count {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let elapsed = start.elapsed();
    relay.shutdown().await;
    rate(count, elapsed)
}

// ---------------------------------------------------------------------------------------------
// The brokers' own limits

async fn amqp_channel() -> (Connection, Channel) {
    let connection =
        Connection::connect(&env("IDEMPOTENT_AMQP_URL"), ConnectionProperties::default())
            .await
            .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    (connection, channel)
}

/// RabbitMQ: `count` persistent, mandatory messages with ids, sent [`WINDOW`] at a time
/// concurrently, each group's confirmations awaited before the next is sent.
async fn rabbitmq_limit_grouped(channel: &Channel, queue: &str, count: usize) -> f64 {
    let start = Instant::now();
    let ids: Vec<usize> = (0..count).collect();
    for group in ids.chunks(WINDOW) {
        let confirms = futures::future::join_all(
            group
                .iter()
                .map(|i| async move { rabbitmq_publish(channel, queue, *i).await.await.unwrap() }),
        )
        .await;
        assert_eq!(confirms.len(), group.len());
    }
    rate(count, start.elapsed())
}

/// RabbitMQ: `count` persistent, mandatory messages with ids, at most [`WINDOW`] unconfirmed.
async fn rabbitmq_limit(channel: &Channel, queue: &str, count: usize) -> f64 {
    rabbitmq_limit_window(channel, queue, count, WINDOW).await
}

/// RabbitMQ: publishes message `i`, persistent and mandatory, with an id of its own; its
/// confirmation to await.
async fn rabbitmq_publish(
    channel: &Channel,
    queue: &str,
    i: usize,
) -> idempotent::broker::rabbitmq::lapin::PublisherConfirm {
    let properties = BasicProperties::default()
        .with_message_id(uuid::Uuid::new_v4().to_string().into())
        .with_delivery_mode(2);
    let options = BasicPublishOptions {
        mandatory: true,
        ..BasicPublishOptions::default()
    };
    channel
        .basic_publish("".into(), queue.into(), options, &payload(i), properties)
        .await
        .unwrap()
}

/// RabbitMQ: `count` persistent, mandatory messages with ids, at most `window` unconfirmed.
async fn rabbitmq_limit_window(channel: &Channel, queue: &str, count: usize, window: usize) -> f64 {
    let start = Instant::now();
    let mut confirms: FuturesUnordered<idempotent::broker::rabbitmq::lapin::PublisherConfirm> =
        FuturesUnordered::new();
    for i in 0..count {
        if confirms.len() >= window {
            confirms.next().await.unwrap().unwrap();
        }
        confirms.push(rabbitmq_publish(channel, queue, i).await);
    }
    while let Some(confirm) = confirms.next().await {
        confirm.unwrap();
    }
    rate(count, start.elapsed())
}

/// RabbitMQ alone, the limit of the commit-to-publish latency: `count` persistent, mandatory
/// messages with ids, published by `workers` tasks at the common pace of one every `every` (as
/// [`latency`]'s handlers commit), on one channel; from each publication to its confirmation,
/// sorted.
async fn rabbitmq_latency(
    channel: &Channel,
    queue: &str,
    count: usize,
    workers: usize,
    every: Duration,
) -> Vec<Duration> {
    let tasks: Vec<_> = (0..workers)
        .map(|worker| {
            let (channel, queue) = (channel.clone(), queue.to_owned());
            tokio::spawn(async move {
                tokio::time::sleep(every * worker as u32).await;
                let mut ticks = tokio::time::interval(every * workers as u32);
                let mut latencies = Vec::new();
                for i in (worker..count).step_by(workers) {
                    ticks.tick().await;
                    let start = Instant::now();
                    rabbitmq_publish(&channel, &queue, i).await.await.unwrap();
                    latencies.push(start.elapsed());
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::with_capacity(count);
    for task in tasks {
        latencies.extend(task.await.unwrap());
    }
    latencies.sort();
    latencies
}

/// The outbox's publisher on its own, without the database: `count` publications, at most
/// [`WINDOW`] at once.
async fn publisher_alone<P: Publisher>(
    publisher: &P,
    destination: &Destination,
    count: usize,
) -> f64 {
    let publications: Vec<Publication> = (0..count).map(|i| publication(destination, i)).collect();
    let start = Instant::now();
    futures::stream::iter(&publications)
        .map(|p| publisher.publish(p))
        .buffer_unordered(WINDOW)
        .for_each(|published| async move { published.unwrap() })
        .await;
    rate(count, start.elapsed())
}

/// A publication as a relay hands it over (read back from a relay's own: the type cannot be built
/// outside the crate).
fn publication(destination: &Destination, i: usize) -> Publication {
    let mut publication = TEMPLATE.lock().unwrap().clone().expect("a template");
    publication.message_id = uuid::Uuid::new_v4().to_string();
    publication.destination = destination.clone();
    publication.payload = payload(i);
    publication
}

/// A publication a relay handed over, to copy.
static TEMPLATE: Mutex<Option<Publication>> = Mutex::new(None);

/// Keeps the first publication it is handed, as a template.
struct Keep;

impl Publisher for Keep {
    async fn publish(&self, publication: &Publication) -> Result<(), PublishError> {
        TEMPLATE
            .lock()
            .unwrap()
            .get_or_insert_with(|| publication.clone());
        Ok(())
    }
}

/// JetStream: `count` messages with `Nats-Msg-Id`, sent [`WINDOW`] at a time concurrently, each
/// group's acknowledgements awaited before the next is sent.
async fn nats_limit_grouped(context: &jetstream::Context, subject: &str, count: usize) -> f64 {
    let start = Instant::now();
    let ids: Vec<usize> = (0..count).collect();
    for group in ids.chunks(WINDOW) {
        futures::future::join_all(group.iter().map(|i| async move {
            let mut headers = HeaderMap::new();
            headers.insert(
                async_nats::header::NATS_MESSAGE_ID,
                uuid::Uuid::new_v4().to_string().as_str(),
            );
            context
                .publish_with_headers(subject.to_owned(), headers, payload(*i).into())
                .await
                .unwrap()
                .await
                .unwrap();
        }))
        .await;
    }
    rate(count, start.elapsed())
}

/// JetStream: `count` messages with `Nats-Msg-Id`, at most [`WINDOW`] unacknowledged.
async fn nats_limit(context: &jetstream::Context, subject: &str, count: usize) -> f64 {
    let start = Instant::now();
    let mut acks = FuturesUnordered::new();
    for i in 0..count {
        if acks.len() >= WINDOW {
            let acked: Result<_, jetstream::context::PublishError> = acks.next().await.unwrap();
            acked.unwrap();
        }
        let mut headers = HeaderMap::new();
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            uuid::Uuid::new_v4().to_string().as_str(),
        );
        let ack = context
            .publish_with_headers(subject.to_owned(), headers, payload(i).into())
            .await
            .unwrap();
        acks.push(ack.into_future());
    }
    while let Some(ack) = acks.next().await {
        ack.unwrap();
    }
    rate(count, start.elapsed())
}

async fn purge(channel: &Channel, queue: &str) {
    channel
        .queue_purge(queue.into(), QueuePurgeOptions::default())
        .await
        .unwrap();
}

// ---------------------------------------------------------------------------------------------
// Latency and handler cost

/// A broker that confirms every message at once: what the relay does without one.
struct Instant0;

impl Publisher for Instant0 {
    async fn publish(&self, _: &Publication) -> Result<(), PublishError> {
        Ok(())
    }
}

/// A publisher that notes when the broker confirmed each message.
struct Timed<P> {
    inner: P,
    confirmed: Mutex<HashMap<String, Instant>>,
}

impl<P: Publisher> Publisher for Timed<P> {
    async fn publish(&self, publication: &Publication) -> Result<(), PublishError> {
        self.inner.publish(publication).await?;
        self.confirmed
            .lock()
            .unwrap()
            .insert(publication.message_id.clone(), Instant::now());
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
enum BenchError {
    #[error("database error")]
    Db(#[from] sqlx::Error),
}

struct Payment {
    message_id: String,
    account: i64,
    destination: Destination,
}

#[idempotent(key = "message_id", consumer = "plain")]
async fn pay(tx: &mut PgConnection, msg: &Payment) -> Result<(), BenchError> {
    sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = $1")
        .bind(msg.account)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

#[idempotent(key = "message_id", consumer = "announcing")]
async fn pay_and_announce(
    tx: &mut PgConnection,
    msg: &Payment,
    outbox: &mut Outbox,
) -> Result<(), BenchError> {
    sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = $1")
        .bind(msg.account)
        .execute(&mut *tx)
        .await?;
    outbox.send(OutgoingMessage::new(
        msg.destination.clone(),
        payload(msg.account as usize),
    ));
    Ok(())
}

/// [`pay_and_announce`] with the relays' `NOTIFY` in its transaction, as the inbox sent it before
/// it sent it after the commit: run on an inbox `with_outbox_notify(false)`.
#[idempotent(key = "message_id", consumer = "announcing")]
async fn pay_and_announce_notifying_in_transaction(
    tx: &mut PgConnection,
    msg: &Payment,
    outbox: &mut Outbox,
) -> Result<(), BenchError> {
    sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = $1")
        .bind(msg.account)
        .execute(&mut *tx)
        .await?;
    sqlx::query("SELECT pg_notify('idempotent_inbox_outbox', '')")
        .execute(&mut *tx)
        .await?;
    outbox.send(OutgoingMessage::new(
        msg.destination.clone(),
        payload(msg.account as usize),
    ));
    Ok(())
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Commits one outgoing message every `every`, `count` in all, spread over `workers` that each
/// commit at their own steady pace, with a relay running; the commit-to-confirmation latencies,
/// sorted. `Notifying::InTransaction`: the handler sends the relays' `NOTIFY` in its transaction,
/// as before they were woken after the commit.
async fn latency(
    inbox: &Inbox<Postgres>,
    queue: &str,
    (options, notifying): (RelayOptions, Notifying),
    count: usize,
    workers: usize,
    every: Duration,
) -> Vec<Duration> {
    let publisher = Arc::new(Timed {
        inner: idempotent::broker::rabbitmq::OutboxPublisher::connect(&env("IDEMPOTENT_AMQP_URL"))
            .await
            .unwrap(),
        confirmed: Mutex::default(),
    });
    let relay = inbox.spawn_relay(publisher.clone(), options);
    tokio::time::sleep(Duration::from_millis(300)).await; // the listener is up
    let committed = Arc::new(Mutex::new(Vec::with_capacity(count)));
    let tasks: Vec<_> = (0..workers)
        .map(|worker| {
            let inbox = match notifying {
                Notifying::AfterCommit => inbox.for_worker(),
                Notifying::InTransaction => inbox.for_worker().with_outbox_notify(false),
            };
            let committed = committed.clone();
            let destination = Destination::queue(queue);
            tokio::spawn(async move {
                // Each worker in its own phase of the common pace.
                tokio::time::sleep(every * worker as u32).await;
                let mut ticks = tokio::time::interval(every * workers as u32);
                for i in (worker..count).step_by(workers) {
                    ticks.tick().await;
                    let msg = Payment {
                        message_id: uuid::Uuid::new_v4().to_string(),
                        account: 1 + (i as i64 % ACCOUNTS),
                        destination: destination.clone(),
                    };
                    let handled = match notifying {
                        Notifying::AfterCommit => pay_and_announce(&inbox, &msg).await,
                        Notifying::InTransaction => {
                            pay_and_announce_notifying_in_transaction(&inbox, &msg).await
                        }
                    };
                    assert!(handled.unwrap().is_processed());
                    let key = idempotent::message_key(&msg.message_id).unwrap();
                    let id = Outbox::derived_id("announcing", &key, 0);
                    committed.lock().unwrap().push((id, Instant::now()));
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    while publisher.confirmed.lock().unwrap().len() < count {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    relay.shutdown().await;
    let confirmed = publisher.confirmed.lock().unwrap();
    let mut latencies: Vec<Duration> = committed
        .lock()
        .unwrap()
        .iter()
        .map(|(id, at)| confirmed[id].saturating_duration_since(*at))
        .collect();
    latencies.sort();
    latencies
}

/// Where a handler's `NOTIFY` is sent.
#[derive(Clone, Copy)]
enum Notifying {
    AfterCommit,
    InTransaction,
}

/// `count` messages through `handler` by 8 workers; messages per second.
async fn handlers<F, Fut>(inbox: &Inbox<Postgres>, count: usize, handler: F) -> f64
where
    F: Fn(Inbox<Postgres>, Payment) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = Instant::now();
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let (inbox, next, handler) = (inbox.for_worker(), next.clone(), handler.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= count {
                        return;
                    }
                    let msg = Payment {
                        message_id: uuid::Uuid::new_v4().to_string(),
                        account: 1 + (i as i64 * 7919) % ACCOUNTS,
                        destination: Destination::queue("bench-cost"),
                    };
                    handler(inbox.clone(), msg).await;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    rate(count, start.elapsed())
}

/// Ordering keys in the keyed drain.
const KEYS: usize = 50;

/// The relay draining `count` rows without ordering keys and with [`KEYS`] of them, at 1 and 4
/// workers, batches of 500, through RabbitMQ, median of 3 rounds; prints the rates, the keyed
/// drain's ratio to the unkeyed one and both rates' ratios to `limit` (the broker's own loop),
/// and the broker's own loop with [`KEYS`] messages unconfirmed at most: a relay publishes one
/// message of a key at a time, so that is the most [`KEYS`] keys can go.
async fn keyed_drain(
    inbox: &Inbox<Postgres>,
    pool: &PgPool,
    channel: &Channel,
    queue: &str,
    count: usize,
    limit: f64,
) {
    const BATCH: usize = 500;
    // The most a relay can do with KEYS keys: one message of each in flight at once.
    let mut ceiling: f64 = 0.0;
    for _ in 0..3 {
        ceiling = ceiling.max(rabbitmq_limit_window(channel, queue, count, KEYS).await);
        purge(channel, queue).await;
    }
    let runs = [(1, 0), (1, KEYS), (4, 0), (4, KEYS)];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); runs.len()];
    for _ in 0..3 {
        for (run, (workers, keys)) in runs.iter().enumerate() {
            reset(pool).await;
            fill_keyed_outbox(inbox, count, &Destination::queue(queue), *keys).await;
            let publisher =
                idempotent::broker::rabbitmq::OutboxPublisher::connect(&env("IDEMPOTENT_AMQP_URL"))
                    .await
                    .unwrap();
            let options = RelayOptions::default().batch_size(BATCH).workers(*workers);
            rates[run].push(drain(inbox, publisher, options, count).await);
            purge(channel, queue).await;
        }
    }
    let median: Vec<f64> = rates
        .into_iter()
        .map(|mut r| {
            r.sort_by(f64::total_cmp);
            r[r.len() / 2]
        })
        .collect();
    println!(
        "\n## Keyed drain ({count} messages each, batches of {BATCH}, RabbitMQ, median of 3 rounds)\n"
    );
    println!(
        "| workers | no ordering key, messages/s | {KEYS} ordering keys, messages/s | keyed / unkeyed | unkeyed × RabbitMQ's own | keyed × RabbitMQ's own |"
    );
    println!("|---|---|---|---|---|---|");
    for (at, workers) in [(0, 1), (2, 4)] {
        let (unkeyed, keyed) = (median[at], median[at + 1]);
        println!(
            "| {workers} | {unkeyed:.0} | {keyed:.0} | {:.2} | {:.2} | {:.2} |",
            keyed / unkeyed,
            unkeyed / limit,
            keyed / limit
        );
    }
    println!(
        "\n(RabbitMQ's own loop, best of 6: {limit:.0} messages/s; with at most {KEYS} unconfirmed, \
         one per key as a keyed relay publishes, best of 3: {ceiling:.0} messages/s, and the \
         keyed drain at 4 workers is {:.2} of it)",
        median[3] / ceiling
    );
}

/// The tenants of the `tenants` section.
const TENANTS: usize = 100;

/// One relay over `TENANTS` tenants' outboxes (schemas of one database, one pool), `count`
/// messages spread evenly, against one outbox with `count`; RabbitMQ, medians of 3 rounds.
async fn tenants_drain(pool: &PgPool, channel: &Channel, queue: &str, count: usize) {
    const BATCH: usize = 500;
    let schemas: Vec<String> = (0..TENANTS)
        .map(|n| format!("bench_tenant_{n:03}"))
        .collect();
    let mut ddl = String::new();
    for schema in &schemas {
        ddl.push_str(&format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema};"
        ));
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(ddl))
        .execute(pool)
        .await
        .unwrap();
    let one = Inbox::new(pool.clone());
    let tenants = Tenants::by_schema(&one, schemas.iter().map(String::as_str)).unwrap();
    tenants.migrate().await.unwrap();
    let truncate: String = schemas
        .iter()
        .map(|s| format!("TRUNCATE {s}.idempotent_inbox_outbox, {s}.idempotent_inbox_outbox_keys;"))
        .collect();
    let destination = Destination::queue(queue);
    let publisher = || async {
        idempotent::broker::rabbitmq::OutboxPublisher::connect(&env("IDEMPOTENT_AMQP_URL"))
            .await
            .unwrap()
    };
    let runs = [1, 4];
    let mut rates: Vec<(Vec<f64>, Vec<f64>)> = vec![Default::default(); runs.len()];
    for _ in 0..3 {
        for (run, workers) in runs.iter().enumerate() {
            let options = RelayOptions::default().batch_size(BATCH).workers(*workers);
            reset(pool).await;
            fill_outbox(&one, count, &destination).await;
            let publisher_one = publisher().await;
            let single = drain(&one, publisher_one, options.clone(), count).await;
            purge(channel, queue).await;

            sqlx::raw_sql(sqlx::AssertSqlSafe(truncate.clone()))
                .execute(pool)
                .await
                .unwrap();
            for (_, inbox) in tenants.iter() {
                fill_outbox(inbox, count / TENANTS, &destination).await;
            }
            let publisher_all = publisher().await;
            let spread = drain_with(
                || tenants.spawn_relay(publisher_all, options),
                count / TENANTS * TENANTS,
            )
            .await;
            purge(channel, queue).await;
            rates[run].0.push(single);
            rates[run].1.push(spread);
        }
    }
    let median = |mut r: Vec<f64>| {
        r.sort_by(f64::total_cmp);
        r[r.len() / 2]
    };
    println!("\n## Tenants ({count} messages, batches of {BATCH}, RabbitMQ, median of 3 rounds)\n");
    println!(
        "| workers | one outbox, messages/s | {TENANTS} tenants' outboxes (schemas, one pool), messages/s | ratio |"
    );
    println!("|---|---|---|---|");
    for (workers, (single, spread)) in runs.iter().zip(rates) {
        let (single, spread) = (median(single), median(spread));
        println!(
            "| {workers} | {single:.0} | {spread:.0} | {:.2} |",
            spread / single
        );
    }
}

/// Backlogs of the `backlog` section: the relay drains `count` rows off the top of each.
const BACKLOGS: [usize; 2] = [20_000, 200_000];

/// How fast a relay drains `count` rows off backlogs of each size in [`BACKLOGS`], without an
/// ordering key and on [`KEYS`] keys, through a broker that confirms at once: what finding the
/// keys' heads costs as a backlog grows. `[backlog][unkeyed, keyed]`, messages/s, median of 3
/// rounds, each drained off a backlog of the size (the rows sent before stay in the table).
async fn backlog_rates<DB: Backend, F, Fut>(
    inbox: &Inbox<DB>,
    count: usize,
    upkeep: F,
) -> [[f64; 2]; 2]
where
    F: Fn(Upkeep) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    inbox.migrate().await.unwrap();
    let destination = Destination::queue("backlog");
    let mut rates = [[0.0; 2]; 2];
    for (at, backlog) in BACKLOGS.into_iter().enumerate() {
        for (keyed, keys) in [0, KEYS].into_iter().enumerate() {
            // Each round drains `drained` rows and writes as many behind the rest.
            let drained = count.min(backlog);
            let mut rounds = Vec::new();
            upkeep(Upkeep::Empty).await;
            fill_keyed_outbox(inbox, backlog, &destination, keys).await;
            for _ in 0..3 {
                upkeep(Upkeep::Analyze).await;
                let options = RelayOptions::default().batch_size(500).workers(4);
                rounds.push(drain(inbox, Instant0, options, drained).await);
                fill_keyed_outbox(inbox, drained, &destination, keys).await;
            }
            rounds.sort_by(f64::total_cmp);
            rates[at][keyed] = rounds[1];
        }
    }
    upkeep(Upkeep::Empty).await;
    rates
}

/// What [`backlog_rates`] asks of a store between runs.
enum Upkeep {
    /// Empty the outbox.
    Empty,
    /// Bring the planner's statistics up to date, as the database's own upkeep would while a
    /// backlog stands (PostgreSQL's autovacuum, InnoDB's persistent statistics).
    Analyze,
}

/// Whether the `backlog` section measures `store` (`BENCH_BACKLOG_STORES`, a comma-separated
/// list of `sqlite`, `postgres`, `mysql`; all when unset).
fn backlog_store(store: &str) -> bool {
    std::env::var("BENCH_BACKLOG_STORES")
        .map_or(true, |stores| stores.split(',').any(|s| s == store))
}

/// The `backlog` section: [`backlog_rates`] on SQLite, PostgreSQL and (with the `mysql` feature
/// and `IDEMPOTENT_MYSQL_URL`) MariaDB or MySQL, as a table.
async fn backlogs(pool: &PgPool, count: usize) {
    let mut rows: Vec<(&str, [[f64; 2]; 2])> = Vec::new();

    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("backlog.db").display());
    let sqlite = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(idempotent::sqlite::connect_options(&url).unwrap())
        .await
        .unwrap();
    let inbox = Inbox::new(sqlite.clone());
    let sqlite = &sqlite;
    let upkeep = |upkeep| async move {
        let sql = match upkeep {
            Upkeep::Empty => {
                "DELETE FROM idempotent_inbox_outbox; DELETE FROM idempotent_inbox_outbox_keys"
            }
            // SQLite's statistics are the user's to gather, and few do.
            Upkeep::Analyze => return,
        };
        sqlx::raw_sql(sql).execute(sqlite).await.unwrap();
    };
    if backlog_store("sqlite") {
        rows.push(("SQLite", backlog_rates(&inbox, count, upkeep).await));
    }

    if backlog_store("postgres") {
        let schema = "bench_backlog";
        let ddl = format!("DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}");
        sqlx::raw_sql(sqlx::AssertSqlSafe(ddl))
            .execute(pool)
            .await
            .unwrap();
        let inbox = Inbox::new(pool.clone()).with_schema(schema).unwrap();
        let upkeep = |upkeep| async move {
            let o = format!("{schema}.idempotent_inbox_outbox");
            let sql = match upkeep {
                Upkeep::Empty => format!("TRUNCATE {o}, {o}_keys"),
                Upkeep::Analyze => format!("VACUUM ANALYZE {o}"),
            };
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(pool)
                .await
                .unwrap();
        };
        rows.push(("PostgreSQL", backlog_rates(&inbox, count, upkeep).await));
        let ddl = format!("DROP SCHEMA {schema} CASCADE");
        sqlx::raw_sql(sqlx::AssertSqlSafe(ddl))
            .execute(pool)
            .await
            .unwrap();
    }

    #[cfg(feature = "mysql")]
    if let (Ok(url), true) = (
        std::env::var("IDEMPOTENT_MYSQL_URL"),
        backlog_store("mysql"),
    ) {
        use std::str::FromStr;
        let options = sqlx::mysql::MySqlConnectOptions::from_str(&url).unwrap();
        let server = sqlx::mysql::MySqlPool::connect_with(options.clone())
            .await
            .unwrap();
        let database = "idempotent_bench_backlog";
        for sql in [
            format!("DROP DATABASE IF EXISTS {database}"),
            format!("CREATE DATABASE {database}"),
        ] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
                .execute(&server)
                .await
                .unwrap();
        }
        let mysql = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(8)
            .connect_with(options.database(database))
            .await
            .unwrap();
        let inbox = Inbox::new(mysql.clone());
        let on = &mysql;
        let upkeep = |upkeep| async move {
            let sql = match upkeep {
                Upkeep::Empty => {
                    "TRUNCATE TABLE idempotent_inbox_outbox; TRUNCATE TABLE idempotent_inbox_outbox_keys"
                }
                Upkeep::Analyze => "ANALYZE TABLE idempotent_inbox_outbox",
            };
            sqlx::raw_sql(sql).execute(on).await.unwrap();
        };
        rows.push(("MariaDB", backlog_rates(&inbox, count, upkeep).await));
        mysql.close().await;
        let sql = format!("DROP DATABASE {database}");
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(&server)
            .await
            .unwrap();
    }

    println!(
        "\n## Backlogs ({count} messages drained off the top, batches of 500, 4 workers, a broker \
         that confirms at once, median of 3 rounds)\n"
    );
    println!(
        "| store | backlog | no ordering key, messages/s | {KEYS} ordering keys, messages/s | keyed / unkeyed |"
    );
    println!("|---|---|---|---|---|");
    for (store, rates) in rows {
        for (backlog, [unkeyed, keyed]) in BACKLOGS.into_iter().zip(rates) {
            println!(
                "| {store} | {backlog} | {unkeyed:.0} | {keyed:.0} | {:.2} |",
                keyed / unkeyed
            );
        }
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs a benchmark without it, and
    // then it measures nothing.
    if !std::env::args().any(|arg| arg == "--bench") {
        return;
    }
    let pg = env("IDEMPOTENT_PG_URL");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(16)
        .connect(&pg)
        .await
        .unwrap();
    let inbox = Inbox::new(pool.clone());
    inbox.migrate().await.unwrap();
    reset(&pool).await;
    let count: usize = std::env::var("BENCH_OUTBOX_MESSAGES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(20_000);

    // The sections named after `--bench` (`throughput`, which includes `keyed`, `latency`, `cost`,
    // `tenants`), or all.
    let named: Vec<String> = std::env::args()
        .skip(1)
        .filter(|arg| !arg.starts_with('-'))
        .collect();
    let wanted = |section: &str| named.is_empty() || named.iter().any(|n| n == section);

    let (_connection, channel) = amqp_channel().await;
    let queue = format!("bench-outbox-{}", uuid::Uuid::new_v4().simple());
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    // RabbitMQ's own publish-with-confirm loop, best of 6: what the relays are measured against.
    let rabbitmq_own = if wanted("throughput") || wanted("keyed") {
        let mut best: f64 = 0.0;
        for _ in 0..3 {
            best = best.max(rabbitmq_limit(&channel, &queue, count).await);
            purge(&channel, &queue).await;
            best = best.max(rabbitmq_limit_grouped(&channel, &queue, count).await);
            purge(&channel, &queue).await;
        }
        best
    } else {
        f64::NAN
    };
    if wanted("throughput") || wanted("keyed") {
        keyed_drain(&inbox, &pool, &channel, &queue, count, rabbitmq_own).await;
    }
    if wanted("tenants") {
        tenants_drain(&pool, &channel, &queue, count).await;
    }
    if wanted("backlog") {
        backlogs(&pool, count).await;
    }
    if wanted("throughput") {
        // 1. Throughput: RabbitMQ.
        let mut throughput = Vec::new();
        let limit = rabbitmq_own;
        throughput.push((
            "RabbitMQ",
            "broker's own loop (best of 6)".to_owned(),
            limit,
            limit,
        ));
        {
            // A publication to copy, from a relay.
            reset(&pool).await;
            fill_outbox(&inbox, 1, &Destination::queue(queue.clone())).await;
            inbox
                .relay_once(&Keep, &RelayOptions::default())
                .await
                .unwrap();
            let publisher =
                idempotent::broker::rabbitmq::OutboxPublisher::connect(&env("IDEMPOTENT_AMQP_URL"))
                    .await
                    .unwrap();
            let alone =
                publisher_alone(&publisher, &Destination::queue(queue.clone()), count).await;
            throughput.push((
                "RabbitMQ",
                "the outbox's publisher alone, no database".to_owned(),
                alone,
                limit,
            ));
            purge(&channel, &queue).await;
        }
        for (batch, workers) in [(100, 1), (500, 1), (500, 2), (500, 4), (1000, 4)] {
            reset(&pool).await;
            fill_outbox(&inbox, count, &Destination::queue(queue.clone())).await;
            let publisher =
                idempotent::broker::rabbitmq::OutboxPublisher::connect(&env("IDEMPOTENT_AMQP_URL"))
                    .await
                    .unwrap();
            let options = RelayOptions::default().batch_size(batch).workers(workers);
            let relayed = drain(&inbox, publisher, options, count).await;
            throughput.push((
                "RabbitMQ",
                format!("relay, batches of {batch}, {workers} worker(s)"),
                relayed,
                limit,
            ));
            purge(&channel, &queue).await;
        }

        // 1. Throughput: NATS JetStream.
        let client = async_nats::connect(env("IDEMPOTENT_NATS_URL"))
            .await
            .unwrap();
        let context = jetstream::new(client);
        let prefix = uuid::Uuid::new_v4().simple().to_string();
        context
            .create_stream(jetstream::stream::Config {
                name: format!("BENCH_{prefix}"),
                subjects: vec![format!("{prefix}.>")],
                duplicate_window: Duration::from_secs(120),
                ..Default::default()
            })
            .await
            .unwrap();
        let subject = format!("{prefix}.paid");
        let limit = {
            let mut best: f64 = 0.0;
            for _ in 0..3 {
                best = best.max(nats_limit(&context, &subject, count).await);
                best = best.max(nats_limit_grouped(&context, &subject, count).await);
            }
            best
        };
        throughput.push((
            "NATS JetStream",
            "broker's own loop (best of 6)".to_owned(),
            limit,
            limit,
        ));
        for (batch, workers) in [(100, 1), (500, 1), (500, 2), (500, 4), (1000, 4)] {
            reset(&pool).await;
            fill_outbox(&inbox, count, &Destination::subject(subject.clone())).await;
            let publisher = idempotent::broker::nats::OutboxPublisher::new(context.clone());
            let options = RelayOptions::default().batch_size(batch).workers(workers);
            let relayed = drain(&inbox, publisher, options, count).await;
            throughput.push((
                "NATS JetStream",
                format!("relay, batches of {batch}, {workers} worker(s)"),
                relayed,
                limit,
            ));
        }

        // The relay's own limit: the database's work, with a broker that confirms at once.
        for (batch, workers) in [(500, 1), (500, 4)] {
            reset(&pool).await;
            fill_outbox(&inbox, count, &Destination::queue("nowhere")).await;
            let options = RelayOptions::default().batch_size(batch).workers(workers);
            let relayed = drain(&inbox, Instant0, options, count).await;
            throughput.push((
                "none (confirms at once)",
                format!("relay, batches of {batch}, {workers} worker(s)"),
                relayed,
                f64::NAN,
            ));
        }

        println!(
            "\n## Relay throughput ({count} messages each, PostgreSQL 15, one machine, 2 cores)\n"
        );
        println!("| broker | publisher | messages/s | × the broker's own |");
        println!("|---|---|---|---|");
        for (broker, what, rate, limit) in &throughput {
            let ratio = if limit.is_nan() {
                "-".to_owned()
            } else {
                format!("{:.2}", rate / limit)
            };
            println!("| {broker} | {what} | {rate:.0} | {ratio} |");
        }
    }

    if wanted("latency") {
        // 2. Latency, at 100 messages per second from one worker, and at 1,000 from 8.
        reset(&pool).await;
        let mut latencies = Vec::new();
        for (label, options, workers, every) in [
            (
                "LISTEN/NOTIFY after the commit (the default), 1 worker at 100/s",
                (RelayOptions::default(), Notifying::AfterCommit),
                1,
                Duration::from_millis(10),
            ),
            (
                "LISTEN/NOTIFY after the commit (the default), 8 workers at 1,000/s",
                (RelayOptions::default(), Notifying::AfterCommit),
                8,
                Duration::from_millis(1),
            ),
            (
                "LISTEN/NOTIFY after the commit, a relay of 4 workers, 8 workers at 1,000/s",
                (RelayOptions::default().workers(4), Notifying::AfterCommit),
                8,
                Duration::from_millis(1),
            ),
            (
                "LISTEN/NOTIFY in the transaction (as before), 8 workers at 1,000/s",
                (RelayOptions::default(), Notifying::InTransaction),
                8,
                Duration::from_millis(1),
            ),
            (
                "polling, back-off 10 ms to 1 s (the default without LISTEN), 1 worker at 100/s",
                (
                    RelayOptions::default().listen(false),
                    Notifying::AfterCommit,
                ),
                1,
                Duration::from_millis(10),
            ),
            (
                "polling every 10 ms, 1 worker at 100/s",
                (
                    RelayOptions::default()
                        .listen(false)
                        .poll_interval(Duration::from_millis(10), Duration::from_millis(10)),
                    Notifying::AfterCommit,
                ),
                1,
                Duration::from_millis(10),
            ),
        ] {
            let count = 1000 * workers;
            let sorted = latency(&inbox, &queue, options, count, workers, every).await;
            latencies.push((label, sorted));
            purge(&channel, &queue).await;
        }
        // The limit: RabbitMQ alone, from publication to confirmation at the same paces.
        for (label, workers, every) in [
            (
                "RabbitMQ alone, publish to confirm (the limit), 1 publisher at 100/s",
                1,
                Duration::from_millis(10),
            ),
            (
                "RabbitMQ alone, publish to confirm (the limit), 8 publishers at 1,000/s",
                8,
                Duration::from_millis(1),
            ),
        ] {
            let sorted = rabbitmq_latency(&channel, &queue, 1000 * workers, workers, every).await;
            latencies.push((label, sorted));
            purge(&channel, &queue).await;
        }
        println!("\n## Commit-to-publish latency (RabbitMQ confirms)\n");
        println!("| relay woken by, committed by | p50 ms | p99 ms | max ms |");
        println!("|---|---|---|---|");
        for (label, sorted) in &latencies {
            println!(
                "| {label} | {} | {} | {} |",
                ms(percentile(sorted, 0.5)),
                ms(percentile(sorted, 0.99)),
                ms(*sorted.last().unwrap())
            );
        }
        plot(&latencies);
    }

    if wanted("cost") {
        // 3. Handler cost.
        reset(&pool).await;
        let handled = 20_000;
        let quiet = inbox.clone().with_outbox_notify(false);
        let mut rounds: [Vec<f64>; 4] = Default::default();
        for _ in 0..3 {
            rounds[0].push(
                handlers(&inbox, handled, |inbox, msg| async move {
                    assert!(pay(&inbox, &msg).await.unwrap().is_processed());
                })
                .await,
            );
            rounds[1].push(
                handlers(&inbox, handled, |inbox, msg| async move {
                    assert!(pay_and_announce(&inbox, &msg).await.unwrap().is_processed());
                })
                .await,
            );
            rounds[2].push(
                handlers(&quiet, handled, |inbox, msg| async move {
                    let announced = pay_and_announce_notifying_in_transaction(&inbox, &msg);
                    assert!(announced.await.unwrap().is_processed());
                })
                .await,
            );
            rounds[3].push(
                handlers(&quiet, handled, |inbox, msg| async move {
                    assert!(pay_and_announce(&inbox, &msg).await.unwrap().is_processed());
                })
                .await,
            );
        }
        let [plain, announcing, in_transaction, quietly] = rounds.map(|mut rates| {
            rates.sort_by(f64::total_cmp);
            rates[1]
        });
        println!("\n## Handler cost ({handled} messages, 8 workers, median of 3 rounds)\n");
        println!("| handler | messages/s | ratio |");
        println!("|---|---|---|");
        println!("| the UPDATE, no outgoing message | {plain:.0} | 1.00 |");
        for (what, rate) in [
            (
                "the UPDATE and one outgoing message (`outbox.send`), relays woken after the commit (the default)",
                announcing,
            ),
            (
                "the same, `NOTIFY` in the transaction (how relays were woken before)",
                in_transaction,
            ),
            (
                "the same, `with_outbox_notify(false)` (relays that poll)",
                quietly,
            ),
        ] {
            println!("| {what} | {rate:.0} | {:.2} |", rate / plain);
        }
    }
}

/// The latencies' distributions, as `docs/bench_outbox.svg`.
fn plot(latencies: &[(&str, Vec<Duration>)]) {
    use plotters::prelude::*;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/bench_outbox.svg");
    let root = SVGBackend::new(&path, (900, 480)).into_drawing_area();
    root.fill(&WHITE).unwrap();
    let max_ms = latencies
        .iter()
        .map(|(_, l)| l.last().unwrap().as_secs_f64() * 1000.0)
        .fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Commit-to-publish latency, 1,000 messages at 100/s (RabbitMQ confirms)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((0.1f64..max_ms * 1.2).log_scale(), 0f64..100f64)
        .unwrap();
    chart
        .configure_mesh()
        .x_desc("milliseconds from the handler's commit to the broker's confirmation (log)")
        .y_desc("% of messages")
        .draw()
        .unwrap();
    let colors = [RED, BLUE, GREEN];
    for ((label, sorted), color) in latencies.iter().zip(colors) {
        let n = sorted.len() as f64;
        let points = sorted.iter().enumerate().map(|(i, d)| {
            (
                (d.as_secs_f64() * 1000.0).max(0.1),
                100.0 * (i + 1) as f64 / n,
            )
        });
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .unwrap()
            .label(*label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .unwrap();
    root.present().unwrap();
    println!("\n(plot: {})", path.display());
}
