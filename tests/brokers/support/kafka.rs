//! Kafka for the tests: the server at `IDEMPOTENT_KAFKA_URL` when it is set (a real broker: tansu,
//! or Apache Kafka), otherwise librdkafka's own mock cluster, in the test's process (three
//! brokers, consumer groups, committed offsets, headers, an idempotent producer). The faults a real
//! server makes hard (every broker down and back, a topic refused) always use a mock cluster.

use std::collections::HashMap;
use std::time::Duration;

use idempotent::broker::kafka::rdkafka::{
    self, ClientConfig, Offset, TopicPartitionList,
    admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
    client::DefaultClientContext,
    consumer::{BaseConsumer, Consumer},
    message::{Header, Headers, OwnedHeaders, OwnedMessage},
    mocking::MockCluster,
    producer::DefaultProducerContext,
    producer::{FutureProducer, FutureRecord},
};

use super::{Kind, Order, Shop};
use idempotent::broker::kafka::{HeldPartition, HeldPartitions, Runner};
use idempotent::broker::{Batches, BrokerError, RunnerStats, Shutdown};

/// A Kafka to test against.
pub struct Kafka {
    servers: String,
    mock: Option<MockCluster<'static, DefaultProducerContext>>,
    producer: FutureProducer,
}

impl Kafka {
    /// The server at `IDEMPOTENT_KAFKA_URL`, or a mock cluster.
    pub fn start() -> Self {
        match std::env::var("IDEMPOTENT_KAFKA_URL") {
            Ok(servers) if !servers.is_empty() => Self::at(servers, None),
            _ => Self::mock(),
        }
    }

    /// A mock cluster of three brokers, whatever `IDEMPOTENT_KAFKA_URL` says.
    pub fn mock() -> Self {
        let mock = MockCluster::new(3).expect("a mock cluster");
        let servers = mock.bootstrap_servers();
        Self::at(servers, Some(mock))
    }

    fn at(servers: String, mock: Option<MockCluster<'static, DefaultProducerContext>>) -> Self {
        let producer = client_at(&servers)
            .set("acks", "all")
            .set("enable.idempotence", "true")
            .create()
            .expect("a producer");
        Self {
            servers,
            mock,
            producer,
        }
    }

    pub fn is_mock(&self) -> bool {
        self.mock.is_some()
    }

    /// The cluster's bootstrap servers, for a process of its own.
    pub fn servers(&self) -> &str {
        &self.servers
    }

    /// The client settings of this cluster.
    pub fn client(&self) -> ClientConfig {
        client_at(&self.servers)
    }

    /// A new topic of `partitions` partitions, named after `prefix` and made unique.
    pub async fn topic(&self, prefix: &str, partitions: i32) -> String {
        let name = format!("{prefix}-{}", uuid::Uuid::new_v4().simple());
        match &self.mock {
            Some(mock) => mock
                .create_topic(&name, partitions, 1)
                .expect("a mock topic"),
            None => {
                let admin: AdminClient<DefaultClientContext> = self.client().create().unwrap();
                let results = admin
                    .create_topics(
                        &[NewTopic::new(&name, partitions, TopicReplication::Fixed(1))],
                        &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
                    )
                    .await
                    .expect("topics created");
                results.into_iter().for_each(|r| {
                    r.expect("the topic is created");
                });
            }
        }
        name
    }

    /// Produces a record to `topic` with `key`, the message id `id` (none: no header) and an
    /// order of `kind` as its payload.
    pub async fn produce(&self, topic: &str, key: &str, id: Option<&str>, kind: Kind) {
        self.produce_raw(topic, key, id, &Order::payload(kind))
            .await
    }

    /// Produces a record with the message id `id` and an order of `kind` to `partition` of
    /// `topic`.
    pub async fn produce_to(&self, topic: &str, partition: i32, id: &str, kind: Kind) {
        self.produce_raw_to(topic, partition, Some(id), &Order::payload(kind))
            .await
    }

    /// Produces a record with the message id `id` (none: no header) and any payload to
    /// `partition` of `topic`.
    pub async fn produce_raw_to(
        &self,
        topic: &str,
        partition: i32,
        id: Option<&str>,
        payload: &[u8],
    ) {
        let mut headers = OwnedHeaders::new();
        if let Some(id) = id {
            headers = headers.insert(Header {
                key: "message-id",
                value: Some(id.as_bytes()),
            });
        }
        let record = FutureRecord::<(), _>::to(topic)
            .partition(partition)
            .payload(payload)
            .headers(headers);
        self.producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(error, _)| error)
            .expect("produced");
    }

    /// Produces a record with any payload.
    pub async fn produce_raw(&self, topic: &str, key: &str, id: Option<&str>, payload: &[u8]) {
        let mut headers = OwnedHeaders::new();
        if let Some(id) = id {
            headers = headers.insert(Header {
                key: "message-id",
                value: Some(id.as_bytes()),
            });
        }
        let record = FutureRecord::to(topic)
            .key(key)
            .payload(payload)
            .headers(headers);
        self.producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(error, _)| error)
            .expect("produced");
    }

    /// Every record of `topic`, from the beginning, in partition and offset order.
    pub async fn records(&self, topic: &str) -> Vec<OwnedMessage> {
        let client = self.client();
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let consumer: BaseConsumer = client
                .clone()
                .set(
                    "group.id",
                    format!("reader-{}", uuid::Uuid::new_v4().simple()),
                )
                .set("enable.auto.commit", "false")
                .create()
                .unwrap();
            let ends = high_watermarks(&consumer, &topic);
            let mut assignment = TopicPartitionList::new();
            for partition in ends.keys() {
                assignment
                    .add_partition_offset(&topic, *partition, Offset::Beginning)
                    .unwrap();
            }
            consumer.assign(&assignment).unwrap();
            let total: i64 = ends.values().sum();
            let mut records = Vec::new();
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while (records.len() as i64) < total && std::time::Instant::now() < deadline {
                if let Some(Ok(record)) = consumer.poll(Duration::from_millis(200)) {
                    records.push(record.detach());
                }
            }
            records.sort_by_key(|r| (r.partition(), r.offset()));
            records
        })
        .await
        .unwrap()
    }

    /// For each partition of `topic`: its end, and the offset `group` committed.
    pub async fn lag(&self, group: &str, topic: &str) -> HashMap<i32, (i64, Option<i64>)> {
        let client = self.client();
        let (group, topic) = (group.to_owned(), topic.to_owned());
        tokio::task::spawn_blocking(move || {
            let consumer: BaseConsumer = client.clone().set("group.id", &group).create().unwrap();
            let ends = high_watermarks(&consumer, &topic);
            let mut list = TopicPartitionList::new();
            for partition in ends.keys() {
                list.add_partition(&topic, *partition);
            }
            let committed = consumer
                .committed_offsets(list, Duration::from_secs(10))
                .unwrap();
            ends.into_iter()
                .map(|(partition, end)| {
                    let offset = committed
                        .find_partition(&topic, partition)
                        .and_then(|p| p.offset().to_raw())
                        .filter(|offset| *offset >= 0);
                    (partition, (end, offset))
                })
                .collect()
        })
        .await
        .unwrap()
    }

    /// The partitions `group`'s runners hold now (none while its holds topic is not made yet).
    pub async fn holds(&self, group: &str) -> Vec<HeldPartition> {
        match HeldPartitions::new(self.client(), group).list().await {
            Ok(holds) => holds,
            Err(BrokerError::NotHeld { .. }) => Vec::new(),
            Err(error) => panic!("listing the holds failed: {error}"),
        }
    }

    /// Whether `group` has committed every record of `topic`.
    pub async fn all_committed(&self, group: &str, topic: &str) -> bool {
        self.lag(group, topic)
            .await
            .values()
            .all(|(end, committed)| committed.unwrap_or(0) == *end)
    }

    /// Asserts that `group` committed every record of `topic`.
    pub async fn nothing_left_uncommitted(&self, group: &str, topic: &str) {
        for (partition, (end, committed)) in self.lag(group, topic).await {
            assert_eq!(
                committed.unwrap_or(0),
                end,
                "partition {partition} of {topic}: committed {committed:?} of {end}"
            );
        }
    }

    /// On a mock cluster: answers every request about `topic` with an authorization error.
    pub fn refuse_topic(&self, topic: &str) {
        if let Some(mock) = &self.mock {
            mock.topic_error(
                topic,
                rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED,
            )
            .unwrap();
        }
    }

    /// On a mock cluster: refuses the next `count` produce requests, whoever makes them, as too
    /// large.
    pub fn refuse_produce(&self, count: usize) {
        let mock = self.mock.as_ref().expect("a mock cluster");
        mock.request_errors(
            rdkafka::types::RDKafkaApiKey::Produce,
            &vec![rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE; count],
        );
    }

    /// Takes every broker down, as a broker restart does.
    pub fn all_down(&self) {
        let mock = self.mock.as_ref().expect("a mock cluster");
        for broker in 1..=3 {
            mock.broker_down(broker).unwrap();
        }
    }

    /// Brings every broker back.
    pub fn all_up(&self) {
        let mock = self.mock.as_ref().expect("a mock cluster");
        for broker in 1..=3 {
            mock.broker_up(broker).unwrap();
        }
    }
}

fn client_at(servers: &str) -> ClientConfig {
    let mut client = ClientConfig::new();
    client
        .set("bootstrap.servers", servers)
        // A test's topics are new: their metadata is fetched again soon.
        .set("topic.metadata.refresh.interval.ms", "1000")
        .set("auto.commit.interval.ms", "200")
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
        // Brokers taken down and brought back: found again within a second.
        .set("reconnect.backoff.max.ms", "1000")
        .set("log_level", "3");
    client
}

/// Each partition of `topic` and its end.
fn high_watermarks(consumer: &BaseConsumer, topic: &str) -> HashMap<i32, i64> {
    let metadata = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .unwrap();
    let partitions = metadata.topics()[0].partitions();
    partitions
        .iter()
        .map(|p| {
            let (_, high) = consumer
                .fetch_watermarks(topic, p.id(), Duration::from_secs(10))
                .unwrap();
            (p.id(), high)
        })
        .collect()
}

/// The value of header `name` of `record`.
pub fn header(record: &OwnedMessage, name: &str) -> Option<String> {
    let headers = record.headers()?;
    headers
        .iter()
        .filter(|h| h.key == name)
        .filter_map(|h| String::from_utf8(h.value?.to_vec()).ok())
        .last()
}

#[allow(unused_imports)]
pub use rdkafka::Message;

/// Runs `runner` with `workers` workers of `shop` in the background.
pub fn spawn(
    runner: Runner,
    shop: &Shop,
    workers: usize,
    shutdown: &Shutdown,
) -> tokio::task::JoinHandle<Result<RunnerStats, BrokerError>> {
    let mut handlers = (0..workers)
        .map(|_| shop.worker())
        .collect::<Vec<_>>()
        .into_iter();
    tokio::spawn(
        runner
            .workers(workers)
            .shutdown_on(shutdown.clone())
            .run(move || handlers.next().expect("one handler per worker")),
    )
}

/// Runs `runner` in batch mode (batches of 10, 20 ms) with `workers` workers of `shop` in the
/// background.
pub fn spawn_batches(
    runner: Runner,
    shop: &Shop,
    workers: usize,
    shutdown: &Shutdown,
) -> tokio::task::JoinHandle<Result<RunnerStats, BrokerError>> {
    let body = shop.batch_body();
    tokio::spawn(
        runner
            .workers(workers)
            .shutdown_on(shutdown.clone())
            .run_batches(
                shop.inbox.clone(),
                "shop",
                Batches::new(10, Duration::from_millis(20)),
                move || body.clone(),
            ),
    )
}
