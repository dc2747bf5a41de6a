//! The second hop over Kafka (`--broker kafka`): the relays publish A's outbox with the Kafka
//! publisher (the ordering key as the record's key), and consumer B is the Kafka runner, in a
//! consumer group of its own. The cluster is librdkafka's mock cluster, in the driver's process
//! (three brokers, which the other processes reach on loopback), or the server at
//! `IDEMPOTENT_KAFKA_URL`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent::Inbox;
use idempotent::broker::kafka::rdkafka::admin::{
    AdminClient, AdminOptions, NewTopic, TopicReplication,
};
use idempotent::broker::kafka::rdkafka::client::DefaultClientContext;
use idempotent::broker::kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use idempotent::broker::kafka::rdkafka::mocking::MockCluster;
use idempotent::broker::kafka::rdkafka::producer::DefaultProducerContext;
use idempotent::broker::kafka::rdkafka::{ClientConfig, TopicPartitionList};
use idempotent::broker::kafka::{OutboxPublisher, Runner};
use idempotent::broker::{Message, RetryPolicy};
use rand::SeedableRng;
use rand::rngs::StdRng;
use sqlx::Postgres;

use crate::roles::{Incoming, Point, pool, roll, say, settle};

/// The cluster of a run.
pub struct Cluster {
    servers: String,
    mock: Option<MockCluster<'static, DefaultProducerContext>>,
}

impl Cluster {
    /// The server at `IDEMPOTENT_KAFKA_URL`, or a mock cluster of three brokers.
    pub fn start() -> Self {
        match std::env::var("IDEMPOTENT_KAFKA_URL") {
            Ok(servers) if !servers.is_empty() => Self {
                servers,
                mock: None,
            },
            _ => {
                let mock = MockCluster::new(3).expect("a mock cluster");
                Self {
                    servers: mock.bootstrap_servers(),
                    mock: Some(mock),
                }
            }
        }
    }

    pub fn servers(&self) -> &str {
        &self.servers
    }

    /// Makes B's topic, of `partitions` partitions, and its dead-letter topic.
    pub async fn topics(&self, topic: &str, partitions: i32) -> Result<(), String> {
        let names = [topic.to_owned(), dead_letters(topic)];
        if let Some(mock) = &self.mock {
            for name in &names {
                mock.create_topic(name, partitions, 1)
                    .map_err(|e| format!("mock topic {name}: {e}"))?;
            }
            return Ok(());
        }
        let admin: AdminClient<DefaultClientContext> =
            client(&self.servers).create().map_err(|e| e.to_string())?;
        let new: Vec<NewTopic> = names
            .iter()
            .map(|name| NewTopic::new(name, partitions, TopicReplication::Fixed(1)))
            .collect();
        let made = admin
            .create_topics(
                &new,
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .map_err(|e| e.to_string())?;
        for result in made {
            result.map_err(|(name, code)| format!("topic {name}: {code}"))?;
        }
        Ok(())
    }
}

/// B's consumer group.
fn group(topic: &str) -> String {
    format!("{topic}-b")
}

fn dead_letters(topic: &str) -> String {
    format!("{topic}.dead")
}

/// The client settings of every process: a killed B's partitions go to the next one after three
/// seconds, and stored offsets are committed every 200 ms.
fn client(servers: &str) -> ClientConfig {
    let mut client = ClientConfig::new();
    client
        .set("bootstrap.servers", servers)
        .set("session.timeout.ms", "3000")
        .set("heartbeat.interval.ms", "300")
        .set("auto.commit.interval.ms", "200")
        .set("reconnect.backoff.max.ms", "1000")
        .set("log_level", "3");
    client
}

/// Whether B's group committed every record of `topic`.
pub async fn drained(servers: &str, topic: &str) -> bool {
    let client = client(servers);
    let topic = topic.to_owned();
    let lag = tokio::task::spawn_blocking(move || -> Option<bool> {
        let timeout = Duration::from_secs(5);
        let consumer: BaseConsumer = client
            .clone()
            .set("group.id", group(&topic))
            .create()
            .ok()?;
        let metadata = consumer.fetch_metadata(Some(&topic), timeout).ok()?;
        let mut list = TopicPartitionList::new();
        let mut ends = Vec::new();
        for partition in metadata.topics().first()?.partitions() {
            let (_, high) = consumer
                .fetch_watermarks(&topic, partition.id(), timeout)
                .ok()?;
            list.add_partition(&topic, partition.id());
            ends.push((partition.id(), high));
        }
        let committed = consumer.committed_offsets(list, timeout).ok()?;
        Some(ends.into_iter().all(|(partition, end)| {
            let offset = committed
                .find_partition(&topic, partition)
                .and_then(|p| p.offset().to_raw())
                .unwrap_or(-1);
            end == 0 || offset >= end
        }))
    });
    matches!(lag.await, Ok(Some(true)))
}

/// A relay's publisher.
pub fn publisher(servers: &str) -> OutboxPublisher {
    OutboxPublisher::new(&client(servers), Duration::from_secs(10)).expect("a Kafka producer")
}

/// Consumer B: the Kafka runner with two workers (on different partitions; a partition's records
/// one at a time, in order). The handler retries what is retryable in place, as the RabbitMQ B
/// does, so that a PostgreSQL restart does not send a record to a retry topic and change its key's
/// order: the runner has no retries (one attempt).
pub async fn consume_b(pg: &str, servers: &str, topic: &str, rate: f64, seed: u64) {
    let inbox = Inbox::<Postgres>::new(pool(pg))
        .with_table("b_inbox")
        .expect("a table name");
    let dice = Arc::new(Mutex::new(StdRng::seed_from_u64(
        seed ^ u64::from(std::process::id()),
    )));
    // A static member: a restarted B takes its partitions back at once, where a new member would
    // wait for the killed one's session to time out and the group to rebalance.
    let mut client = client(servers);
    client.set("group.instance.id", "b");
    let runner = Runner::new(client, group(topic), &[topic], dead_letters(topic))
        .workers(2)
        .retry(RetryPolicy::new(1, Duration::from_millis(100)));
    let stats = runner
        .run(|| {
            let inbox = inbox.for_worker();
            let dice = dice.clone();
            move |message: Message| {
                let inbox = inbox.clone();
                let crash = roll(&dice, rate);
                async move {
                    let incoming = Incoming {
                        message_id: message.message_id.0,
                        payload: serde_json::from_slice(&message.payload).expect("a payload"),
                        crash,
                        role: "b",
                    };
                    let handled = settle(&inbox, &incoming).await;
                    // Before the runner stores the offset: a kill here delivers it again.
                    incoming.crash_at(Point::AfterCommit).await;
                    say(&format!(
                        "B {} {}",
                        incoming.message_id,
                        if handled.is_duplicate() {
                            "duplicate"
                        } else {
                            "processed"
                        }
                    ));
                    Ok::<_, idempotent::Error<crate::roles::ChaosError>>(handled)
                }
            }
        })
        .await;
    eprintln!("consumer b: the Kafka runner ended: {stats:?}");
}
