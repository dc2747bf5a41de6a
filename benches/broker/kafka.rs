//! The Kafka section of the broker benchmark (feature `kafka`): librdkafka's mock cluster in this
//! process (three brokers), or the server at `IDEMPOTENT_KAFKA_URL`. Every consumer's clock starts
//! at its first record: joining the group (and, for the runner's first round, making its retry and
//! dead-letter topics) is not the rate.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idempotent::Inbox;
use idempotent::broker::kafka::rdkafka::admin::{
    AdminClient, AdminOptions, NewTopic, TopicReplication,
};
use idempotent::broker::kafka::rdkafka::client::DefaultClientContext;
use idempotent::broker::kafka::rdkafka::consumer::{Consumer, StreamConsumer};
use idempotent::broker::kafka::rdkafka::message::{Header, Headers, OwnedHeaders};
use idempotent::broker::kafka::rdkafka::mocking::MockCluster;
use idempotent::broker::kafka::rdkafka::producer::{
    DefaultProducerContext, FutureProducer, FutureRecord,
};
use idempotent::broker::kafka::rdkafka::{ClientConfig, Message as _};
use idempotent::broker::kafka::{MESSAGE_ID_HEADER, OutboxPublisher, Runner};
use idempotent::broker::{RunnerStats, Shutdown};
use idempotent::outbox::{Destination, OutgoingMessage, Publication, Publisher};
use sqlx::{PgPool, Postgres};

use super::{body, counted, handle, messages, rate, record, reset, runner_cases, total, worker};

/// Partitions of each topic: one per worker of the runner's largest case.
const PARTITIONS: i32 = 8;
/// The runner's retry topics' prefix and its dead-letter topic, the same in every case: made once.
const RETRY: &str = "bench.retry";
const DEAD: &str = "bench.dead";

/// The cluster of a run.
pub struct Kafka {
    servers: String,
    mock: Option<MockCluster<'static, DefaultProducerContext>>,
    producer: FutureProducer,
}

impl Kafka {
    pub async fn start() -> Self {
        let (servers, mock) = match std::env::var("IDEMPOTENT_KAFKA_URL") {
            Ok(servers) if !servers.is_empty() => (servers, None),
            _ => {
                let mock = MockCluster::new(3).expect("a mock cluster");
                (mock.bootstrap_servers(), Some(mock))
            }
        };
        let producer = producer(&servers);
        let kafka = Self {
            servers,
            mock,
            producer,
        };
        kafka.topic(DEAD).await;
        kafka
    }

    /// Where the figures come from.
    pub fn name(&self) -> &'static str {
        if self.mock.is_some() {
            "librdkafka's mock cluster (3 brokers, in this process)"
        } else {
            "the server at IDEMPOTENT_KAFKA_URL"
        }
    }

    fn client(&self) -> ClientConfig {
        let mut client = ClientConfig::new();
        client
            .set("bootstrap.servers", &self.servers)
            .set("log_level", "3");
        client
    }

    async fn topic(&self, name: &str) {
        match &self.mock {
            Some(mock) => mock.create_topic(name, PARTITIONS, 1).expect("a topic"),
            None => {
                let admin: AdminClient<DefaultClientContext> = self.client().create().unwrap();
                let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
                let new = NewTopic::new(name, PARTITIONS, TopicReplication::Fixed(1));
                let _ = admin.create_topics(&[new], &options).await.unwrap();
            }
        }
    }

    /// A new topic holding `messages`, each keyed and headed by its id.
    async fn fill(&self, messages: &[(String, Vec<u8>)]) -> String {
        let topic = format!("bench-{}", uuid::Uuid::new_v4().simple());
        self.topic(&topic).await;
        let sends = messages.iter().map(|(id, payload)| {
            self.producer
                .send(payment(&topic, id, payload), Duration::from_secs(30))
        });
        for sent in futures::future::join_all(sends).await {
            sent.map_err(|(error, _)| error).unwrap();
        }
        topic
    }

    /// A consumer in a new group, storing its offsets itself, at the beginning of `topic`.
    fn consumer(&self, topic: &str) -> StreamConsumer {
        let consumer: StreamConsumer = self
            .client()
            .set("group.id", format!("{topic}-group"))
            .set("enable.auto.commit", "true")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .create()
            .unwrap();
        consumer.subscribe(&[topic]).unwrap();
        consumer
    }
}

fn producer(servers: &str) -> FutureProducer {
    let mut client = ClientConfig::new();
    client
        .set("bootstrap.servers", servers)
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .set("log_level", "3");
    client.create().unwrap()
}

fn payment<'a>(topic: &'a str, id: &'a str, payload: &'a [u8]) -> FutureRecord<'a, str, [u8]> {
    FutureRecord::to(topic)
        .key(id)
        .payload(payload)
        .headers(OwnedHeaders::new().insert(Header {
            key: MESSAGE_ID_HEADER,
            value: Some(id.as_bytes()),
        }))
}

fn message_id(message: &impl idempotent::broker::kafka::rdkafka::Message) -> String {
    let headers = message.headers().expect("headers");
    let header = headers
        .iter()
        .find(|h| h.key == MESSAGE_ID_HEADER)
        .expect("a message id");
    String::from_utf8(header.value.unwrap().to_vec()).unwrap()
}

/// The consumer measurements: the broker alone, a hand-written loop, the runner's cases.
pub async fn consume(
    kafka: &Kafka,
    pool: &PgPool,
    inbox: &Inbox<Postgres>,
    count: usize,
) -> Vec<(&'static str, f64)> {
    eprintln!("Kafka ({}), {count} messages:", kafka.name());
    let mut rows = Vec::new();

    // The broker's limit: receive and store each offset, nothing else.
    let batch = messages(count, true);
    let topic = kafka.fill(&batch).await;
    let consumer = kafka.consumer(&topic);
    let first = consumer.recv().await.unwrap();
    consumer.store_offset_from_message(&first).unwrap();
    drop(first);
    let start = Instant::now();
    for _ in 1..batch.len() {
        let message = consumer.recv().await.unwrap();
        consumer.store_offset_from_message(&message).unwrap();
    }
    record(
        &mut rows,
        "broker, no database",
        rate(batch.len() - 1, start.elapsed()),
    );
    drop(consumer);

    // A hand-written loop with the handler, one worker: a failure produced to the dead-letter
    // topic (acknowledged by all replicas) before its offset is stored, as the runner does.
    reset(pool).await;
    let batch = messages(count, true);
    let topic = kafka.fill(&batch).await;
    let consumer = kafka.consumer(&topic);
    let worker_inbox = inbox.for_worker();
    let mut start = None;
    for _ in 0..batch.len() {
        let message = consumer.recv().await.unwrap();
        start.get_or_insert_with(Instant::now);
        let payload = message.payload().unwrap_or_default();
        if handle(&worker_inbox, message_id(&message), payload)
            .await
            .is_err()
        {
            let id = message_id(&message);
            kafka
                .producer
                .send(payment(DEAD, &id, payload), Duration::from_secs(30))
                .await
                .map_err(|(error, _)| error)
                .unwrap();
        }
        consumer.store_offset_from_message(&message).unwrap();
    }
    let elapsed = start.unwrap().elapsed();
    record(
        &mut rows,
        "hand-written loop, 1 worker",
        rate(batch.len() - 1, elapsed),
    );
    drop(consumer);

    for (label, workers, batches) in runner_cases() {
        reset(pool).await;
        let batch = messages(count, true);
        let topic = kafka.fill(&batch).await;
        let shutdown = Shutdown::new();
        let runner = Runner::new(kafka.client(), format!("{topic}-group"), &[&topic], DEAD)
            .retry_topics(RETRY)
            .workers(workers)
            .shutdown_on(shutdown.clone());
        let stats = Arc::new(runner.stats());
        let inbox = inbox.clone();
        let counting = stats.clone();
        let per_second = match batches {
            None => {
                let run = runner.run(move || worker(&inbox));
                from_first(batch.len(), run, move || total(&counting()), shutdown).await
            }
            Some(batches) => {
                let run = runner.run_batches(inbox, "bench", batches, || body);
                from_first(batch.len(), run, move || total(&counting()), shutdown).await
            }
        };
        eprintln!("  {label}: {}", counted(&stats()));
        record(&mut rows, label, per_second);
    }
    rows
}

/// Runs `run` until `settled` says every message was settled, then cancels it; messages per second
/// from the first settled one.
async fn from_first<F>(count: usize, run: F, settled: impl Fn() -> usize, shutdown: Shutdown) -> f64
where
    F: std::future::Future<Output = Result<RunnerStats, idempotent::broker::BrokerError>>
        + Send
        + 'static,
{
    let task = tokio::spawn(run);
    while settled() < 1 {
        assert!(!task.is_finished(), "the runner ended: {:?}", task.await);
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let (start, from) = (Instant::now(), settled());
    while settled() < count {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let elapsed = start.elapsed();
    shutdown.cancel();
    let _ = task.await;
    rate(count - from, elapsed)
}

/// The publisher measurements: rdkafka's own producer (`acks=all`, idempotent) and the outbox's
/// Kafka publisher, each a message at a time (as a relay with one key in flight) and 64 at a time.
pub async fn publish(kafka: &Kafka, count: usize) -> Vec<(&'static str, f64)> {
    eprintln!("Kafka publishing, {count} messages:");
    let mut rows = Vec::new();
    let batch = messages(count, false);
    let publisher = OutboxPublisher::new(&kafka.client(), Duration::from_secs(30)).unwrap();
    for (label, at_once, ours) in [
        ("rdkafka's producer, 1 at a time", 1, false),
        ("outbox publisher, 1 at a time", 1, true),
        ("rdkafka's producer, 64 at a time", 64, false),
        ("outbox publisher, 64 at a time", 64, true),
    ] {
        let topic = format!("bench-{}", uuid::Uuid::new_v4().simple());
        kafka.topic(&topic).await;
        let sent = AtomicUsize::new(0);
        let start = Instant::now();
        for group in batch.chunks(at_once) {
            let sends = group.iter().map(|(id, payload)| {
                let (topic, publisher, producer) = (&topic, &publisher, &kafka.producer);
                async move {
                    if ours {
                        let message =
                            OutgoingMessage::new(Destination::topic(topic), payload.clone())
                                .with_ordering_key(id.clone());
                        publisher
                            .publish(&Publication::new(id, &message))
                            .await
                            .unwrap();
                    } else {
                        producer
                            .send(payment(topic, id, payload), Duration::from_secs(30))
                            .await
                            .map_err(|(error, _)| error)
                            .unwrap();
                    }
                }
            });
            futures::future::join_all(sends).await;
            sent.fetch_add(group.len(), Ordering::Relaxed);
        }
        record(&mut rows, label, rate(sent.into_inner(), start.elapsed()));
    }
    rows
}
