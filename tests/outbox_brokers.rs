//! The outbox's publishers against the real brokers (`IDEMPOTENT_AMQP_URL`, `IDEMPOTENT_NATS_URL`,
//! started by `scripts/test`): a handler queues its follow-up messages in its outbox, a relay
//! publishes them, each with the outbox's id as the broker's message id (AMQP `message_id`,
//! `Nats-Msg-Id`), persistent and confirmed; a message the broker cannot route is parked with the
//! broker's reason; rows published a second time (as after a relay that died between the
//! confirmation and marking them sent) reach a downstream `#[idempotent(key = "message_id")]`
//! handler as duplicates (RabbitMQ) or are dropped by the stream itself (JetStream).
#![cfg(all(feature = "rabbitmq", feature = "nats", feature = "sqlite"))]

use std::collections::HashMap;
use std::time::{Duration, Instant};

use idempotent::outbox::{Destination, Outbox, OutboxState, OutgoingMessage, RelayOptions};
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_gets_each_message_persistent_with_the_outbox_id_and_unroutable_ones_are_parked() {
    use lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable};
    use lapin::{Connection, ConnectionProperties};

    let url = std::env::var("IDEMPOTENT_AMQP_URL")
        .expect("IDEMPOTENT_AMQP_URL is not set: run the tests with scripts/test");
    let connection = Connection::connect(&url, ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let queue = format!("outbox-{}", uuid::Uuid::new_v4().simple());
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();

    let two = Two::new().await;
    let ids = two
        .orders("paid", 20, &Destination::queue(queue.clone()))
        .await;
    let unroutable = Destination::exchange("amq.direct", format!("nobody-{queue}"));
    let lost = two.orders("unroutable", 1, &unroutable).await;
    let publisher = idempotent::broker::rabbitmq::OutboxPublisher::connect(&url)
        .await
        .unwrap();
    let relay = two.producer.spawn_relay(publisher, options());
    two.until_published(20, 1).await;

    let parked = two.producer.parked_messages(None, 10).await.unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(
        (parked[0].message_id.as_str(), parked[0].state),
        (lost[0].as_str(), OutboxState::Parked)
    );
    let reason = parked[0].last_error.clone().unwrap();
    assert!(reason.contains("NO_ROUTE"), "{reason}");

    // Published again, as after a relay that died after the confirmations: the same ids.
    assert_eq!(two.as_if_never_marked().await, 20);
    two.until_published(20, 1).await;
    let stats = relay.shutdown().await;
    assert_eq!((stats.published, stats.parked), (40, 1));

    let mut deliveries = Vec::new();
    while let Some(delivery) = channel
        .basic_get(queue.as_str().into(), BasicGetOptions::default())
        .await
        .unwrap()
    {
        let properties = &delivery.properties;
        assert_eq!(*properties.delivery_mode(), Some(2), "not persistent");
        let id = properties.message_id().as_ref().unwrap().to_string();
        let header = properties
            .headers()
            .as_ref()
            .and_then(|headers| headers.inner().get("order-id").cloned());
        let order = String::from_utf8(delivery.data.clone()).unwrap();
        assert_eq!(
            header,
            Some(AMQPValue::LongString(order.as_str().into())),
            "headers lost"
        );
        let handled = downstream(
            &two.downstream,
            &Incoming {
                message_id: id.clone(),
                payload: delivery.data.clone(),
            },
        )
        .await
        .unwrap();
        deliveries.push((id, handled.is_duplicate()));
        delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    assert_eq!(deliveries.len(), 40, "every row twice");
    assert_eq!(deliveries.iter().filter(|(_, dup)| *dup).count(), 20);
    let received = two.received().await;
    let mut got: Vec<&String> = received.keys().collect();
    got.sort();
    let mut expected: Vec<&String> = ids.iter().collect();
    expected.sort();
    assert_eq!(
        got, expected,
        "the downstream keys are not the outbox's ids"
    );
    assert!(received.values().all(|n| *n == 1), "{received:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_stores_each_message_with_the_outbox_id_once_and_subjects_without_a_stream_are_parked()
 {
    use futures::StreamExt;
    use idempotent::broker::nats::async_nats::{self, jetstream};

    let url = std::env::var("IDEMPOTENT_NATS_URL")
        .expect("IDEMPOTENT_NATS_URL is not set: run the tests with scripts/test");
    let client = async_nats::connect(&url).await.unwrap();
    let context = jetstream::new(client);
    let prefix = uuid::Uuid::new_v4().simple().to_string();
    let stream = context
        .create_stream(jetstream::stream::Config {
            name: format!("O_{prefix}"),
            subjects: vec![format!("{prefix}.>")],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await
        .unwrap();

    let two = Two::new().await;
    let ids = two
        .orders("paid", 20, &Destination::subject(format!("{prefix}.paid")))
        .await;
    let lost = two
        .orders(
            "nowhere",
            1,
            &Destination::subject(format!("nostream-{prefix}.paid")),
        )
        .await;
    let publisher = idempotent::broker::nats::OutboxPublisher::new(context.clone());
    let relay = two.producer.spawn_relay(publisher, options());
    two.until_published(20, 1).await;
    let parked = two.producer.parked_messages(None, 10).await.unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].message_id, lost[0]);
    let reason = parked[0].last_error.clone().unwrap();
    assert!(reason.contains("no stream"), "{reason}");

    // Published again: JetStream acknowledges the copies as duplicates of the ids it stored.
    assert_eq!(two.as_if_never_marked().await, 20);
    two.until_published(20, 1).await;
    relay.shutdown().await;
    let mut info = context.get_stream(format!("O_{prefix}")).await.unwrap();
    assert_eq!(info.info().await.unwrap().state.messages, 20);

    let consumer: jetstream::consumer::PullConsumer = stream
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("downstream".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let mut messages = consumer.fetch().max_messages(100).messages().await.unwrap();
    let mut seen = 0;
    while let Some(message) = messages.next().await {
        let message = message.unwrap();
        let headers = message.headers.clone().unwrap();
        let id = headers
            .get(async_nats::header::NATS_MESSAGE_ID)
            .unwrap()
            .to_string();
        let order = String::from_utf8(message.payload.to_vec()).unwrap();
        assert_eq!(
            headers.get("order-id").unwrap().as_str(),
            order,
            "headers lost"
        );
        let incoming = Incoming {
            message_id: id,
            payload: message.payload.to_vec(),
        };
        assert!(
            downstream(&two.downstream, &incoming)
                .await
                .unwrap()
                .is_processed()
        );
        message.ack().await.unwrap();
        seen += 1;
    }
    assert_eq!(seen, 20);
    let received = two.received().await;
    let mut got: Vec<&String> = received.keys().collect();
    got.sort();
    let mut expected: Vec<&String> = ids.iter().collect();
    expected.sort();
    assert_eq!(got, expected);
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
    let unique: std::collections::HashSet<&String> = got.iter().collect();
    let wanted: std::collections::HashSet<&String> = expected.iter().collect();
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

/// One row addressed to an exchange that does not exist, the oldest, among 200 good rows: the
/// broker closes a channel that publishes to a missing exchange (404), which must not take the
/// others down with it. Every good row is published, and the bad one is parked with the broker's
/// reason after its attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_a_missing_exchange_is_parked_and_holds_up_none_of_200_other_rows() {
    let (channel, queue) = rabbitmq_queue(lapin::types::FieldTable::default()).await;
    let two = Two::new().await;
    let missing = Destination::exchange(format!("missing-{queue}"), "paid");
    let lost = two.orders("missing", 1, &missing).await;
    let ids = two
        .orders("paid", 200, &Destination::queue(queue.clone()))
        .await;
    let publisher = idempotent::broker::rabbitmq::OutboxPublisher::connect(&amqp_url())
        .await
        .unwrap();
    let relay = two
        .producer
        .spawn_relay(publisher, options().batch_size(50));
    two.until_published(200, 1).await;
    relay.shutdown().await;
    let parked = two.producer.parked_messages(None, 10).await.unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].message_id, lost[0]);
    assert_eq!(parked[0].attempts, 2);
    let reason = parked[0].last_error.clone().unwrap();
    assert!(reason.contains("NOT_FOUND"), "{reason}");
    each_at_least_once(&rabbitmq_ids(&channel, &queue).await, &ids);
}

/// The same on JetStream: one row to a subject that no stream captures, the oldest, among 200 good
/// rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_subject_without_a_stream_is_parked_and_holds_up_none_of_200_other_rows() {
    use idempotent::broker::nats::async_nats::{self, jetstream};
    let url = std::env::var("IDEMPOTENT_NATS_URL")
        .expect("IDEMPOTENT_NATS_URL is not set: run the tests with scripts/test");
    let context = jetstream::new(async_nats::connect(&url).await.unwrap());
    let prefix = uuid::Uuid::new_v4().simple().to_string();
    context
        .create_stream(jetstream::stream::Config {
            name: format!("O_{prefix}"),
            subjects: vec![format!("{prefix}.>")],
            ..Default::default()
        })
        .await
        .unwrap();
    let two = Two::new().await;
    let nowhere = Destination::subject(format!("nostream-{prefix}.paid"));
    let lost = two.orders("nowhere", 1, &nowhere).await;
    two.orders("paid", 200, &Destination::subject(format!("{prefix}.paid")))
        .await;
    let publisher = idempotent::broker::nats::OutboxPublisher::new(context.clone());
    let relay = two
        .producer
        .spawn_relay(publisher, options().batch_size(50));
    two.until_published(200, 1).await;
    relay.shutdown().await;
    let parked = two.producer.parked_messages(None, 10).await.unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(
        (parked[0].message_id.as_str(), parked[0].attempts),
        (lost[0].as_str(), 2)
    );
    let mut info = context.get_stream(format!("O_{prefix}")).await.unwrap();
    assert_eq!(info.info().await.unwrap().state.messages, 200);
}

/// A queue that is full and refuses publishes (`x-max-length` 1, `x-overflow: reject-publish`)
/// gets the oldest row; 1,000 rows go to a healthy queue. The refusal is the row's own: it is
/// retried after its own back-off and parked after its attempts, while every healthy row goes
/// out (the whole relay backing off at each refusal would take minutes); once the queue has room,
/// the parked row retried by hand is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_a_full_queue_refusing_publishes_backs_off_alone_while_the_rest_flows() {
    use lapin::options::{BasicPublishOptions, QueuePurgeOptions};
    use lapin::types::{AMQPValue, FieldTable, ShortString};
    let mut limited = FieldTable::default();
    limited.insert(ShortString::from("x-max-length"), AMQPValue::LongLongInt(1));
    limited.insert(
        ShortString::from("x-overflow"),
        AMQPValue::LongString("reject-publish".into()),
    );
    let (channel, full) = rabbitmq_queue(limited).await;
    let confirmation = channel
        .basic_publish(
            "".into(),
            full.as_str().into(),
            BasicPublishOptions::default(),
            b"filler",
            lapin::BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(
        confirmation.is_ack(),
        "the queue did not take its one message"
    );
    let (_, healthy) = rabbitmq_queue(FieldTable::default()).await;

    let two = Two::new().await;
    let refused = two
        .orders("refused", 1, &Destination::queue(full.clone()))
        .await;
    let ids = two
        .orders("paid", 1000, &Destination::queue(healthy.clone()))
        .await;
    let publisher = idempotent::broker::rabbitmq::OutboxPublisher::connect(&amqp_url())
        .await
        .unwrap();
    let options = options()
        .batch_size(50)
        .attempts(3, Duration::from_millis(200));
    let relay = two.producer.spawn_relay(publisher, options);
    two.until_published(1000, 1).await;
    let parked = two.producer.parked_messages(None, 10).await.unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(
        (parked[0].message_id.as_str(), parked[0].attempts),
        (refused[0].as_str(), 3)
    );
    let reason = parked[0].last_error.clone().unwrap();
    assert!(reason.contains("basic.nack"), "{reason}");
    each_at_least_once(&rabbitmq_ids(&channel, &healthy).await, &ids);

    // Room is made: retried by hand, the row is delivered.
    channel
        .queue_purge(full.as_str().into(), QueuePurgeOptions::default())
        .await
        .unwrap();
    assert!(two.producer.retry_parked(parked[0].row).await.unwrap());
    two.until_published(1001, 0).await;
    relay.shutdown().await;
    assert_eq!(rabbitmq_ids(&channel, &full).await, refused);
}

/// The same on JetStream: a stream that is full and refuses more (`max_messages` 1,
/// `DiscardPolicy::New`) gets the oldest row, 200 rows go to another stream. The refused row is
/// parked after its attempts while the 200 go out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_a_full_stream_refusing_messages_backs_off_alone_while_the_rest_flows() {
    use idempotent::broker::nats::async_nats::{self, jetstream};
    let url = std::env::var("IDEMPOTENT_NATS_URL")
        .expect("IDEMPOTENT_NATS_URL is not set: run the tests with scripts/test");
    let context = jetstream::new(async_nats::connect(&url).await.unwrap());
    let prefix = uuid::Uuid::new_v4().simple().to_string();
    for (name, max_messages) in [("FULL", 1), ("OPEN", -1)] {
        context
            .create_stream(jetstream::stream::Config {
                name: format!("{name}_{prefix}"),
                subjects: vec![format!("{prefix}.{name}")],
                max_messages,
                discard: jetstream::stream::DiscardPolicy::New,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    context
        .publish(format!("{prefix}.FULL"), "filler".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let two = Two::new().await;
    let refused = two
        .orders(
            "refused",
            1,
            &Destination::subject(format!("{prefix}.FULL")),
        )
        .await;
    two.orders("paid", 200, &Destination::subject(format!("{prefix}.OPEN")))
        .await;
    let publisher = idempotent::broker::nats::OutboxPublisher::new(context.clone());
    let options = options()
        .batch_size(50)
        .attempts(3, Duration::from_millis(200));
    let relay = two.producer.spawn_relay(publisher, options);
    two.until_published(200, 1).await;
    relay.shutdown().await;
    let parked = two.producer.parked_messages(None, 10).await.unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(
        (parked[0].message_id.as_str(), parked[0].attempts),
        (refused[0].as_str(), 3)
    );
    let reason = parked[0].last_error.clone().unwrap();
    assert!(reason.contains("the stream refused"), "{reason}");
    let mut info = context.get_stream(format!("OPEN_{prefix}")).await.unwrap();
    assert_eq!(info.info().await.unwrap().state.messages, 200);
}

/// Runs `rabbitmqctl` on the test broker's node (`IDEMPOTENT_AMQP_CTL`, which `scripts/rabbitmq
/// start` prints).
fn rabbitmqctl(args: &str) {
    let ctl = std::env::var("IDEMPOTENT_AMQP_CTL")
        .expect("IDEMPOTENT_AMQP_CTL is not set: run the tests with scripts/test");
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{ctl} {args}"))
        .status()
        .unwrap();
    assert!(status.success(), "rabbitmqctl {args}: {status}");
}

/// A memory alarm on the test broker for as long as it lives: RabbitMQ blocks every connection
/// that publishes.
struct MemoryAlarm;

impl MemoryAlarm {
    fn raise() -> Self {
        rabbitmqctl("eval 'rabbit_alarm:set_alarm({{resource_limit, memory, node()}, []}).'");
        Self
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        rabbitmqctl("eval 'rabbit_alarm:clear_alarm({resource_limit, memory, node()}).'");
    }
}

/// A memory alarm while a relay publishes 1,000 rows: the broker blocks the publisher's
/// connection, so no publication is confirmed until the alarm clears. The relay waits out each
/// publication at most its `publish_timeout`, several times over; it neither hangs (its shutdown
/// returns) nor loses a row, goes on once the alarm clears, and publishes a row again only if the
/// broker may not have it: at most one batch's rows arrive twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_memory_alarm_holds_the_relay_until_it_clears_without_losing_or_doubling_rows() {
    let (channel, queue) = rabbitmq_queue(lapin::types::FieldTable::default()).await;
    let two = Two::new().await;
    let ids = two
        .orders("paid", 1000, &Destination::queue(queue.clone()))
        .await;
    let publisher = idempotent::broker::rabbitmq::OutboxPublisher::connect(&amqp_url())
        .await
        .unwrap();
    const BATCH: usize = 100;
    let options = options()
        .batch_size(BATCH)
        .publish_timeout(Duration::from_millis(500));
    let alarm = MemoryAlarm::raise();
    let relay = two.producer.spawn_relay(publisher, options);
    // The relay tried and found no confirmation, again and again.
    let start = Instant::now();
    while relay.stats().retried < 4 * BATCH as u64 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the relay did not try: {:?}",
            relay.stats()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let during = two.producer.outbox_stats().await.unwrap();
    assert_eq!(during.sent, 0, "sent while the broker blocked publishing");
    drop(alarm);
    two.until_published(1000, 0).await;
    let stats = tokio::time::timeout(Duration::from_secs(30), relay.shutdown())
        .await
        .expect("the relay's shutdown hung");
    let got = rabbitmq_ids(&channel, &queue).await;
    let doubled = each_at_least_once(&got, &ids);
    eprintln!(
        "memory alarm: {} publications of 1,000 rows, {doubled} duplicates; relay {stats:?}",
        got.len()
    );
    assert!(
        doubled <= BATCH,
        "{doubled} duplicate publications for 1,000 rows"
    );
}

/// The README's figure: a memory alarm of 15 s over a relay with 1,000 rows to publish, with the
/// default `publish_timeout` (10 s) and with 2 s; prints the duplicates the queue got and how
/// long after the alarm cleared the last row was sent. A measurement, run by hand:
/// `cargo test --all-features --test outbox_brokers -- --ignored --nocapture alarm_of_15_s`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement of about 40 s, for the README"]
async fn rabbitmq_memory_alarm_of_15_s_duplicates_measured() {
    for timeout in [10, 2] {
        let (channel, queue) = rabbitmq_queue(lapin::types::FieldTable::default()).await;
        let two = Two::new().await;
        let ids = two
            .orders("paid", 1000, &Destination::queue(queue.clone()))
            .await;
        let publisher = idempotent::broker::rabbitmq::OutboxPublisher::connect(&amqp_url())
            .await
            .unwrap();
        let alarm = MemoryAlarm::raise();
        let options = RelayOptions::default().publish_timeout(Duration::from_secs(timeout));
        let relay = two.producer.spawn_relay(publisher, options);
        // The alarm's length is what is measured, not a wait for something.
        tokio::time::sleep(Duration::from_secs(15)).await;
        drop(alarm);
        let cleared = Instant::now();
        two.until_published(1000, 0).await;
        let resumed = cleared.elapsed();
        relay.shutdown().await;
        let got = rabbitmq_ids(&channel, &queue).await;
        let doubled = each_at_least_once(&got, &ids);
        eprintln!(
            "publish_timeout {timeout} s: {doubled} duplicates of 1,000 rows; all sent {resumed:?} \
             after the alarm cleared"
        );
    }
}
