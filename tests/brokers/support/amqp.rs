//! The RabbitMQ side of the runners' tests: queues, publications, and what is in a queue.

use idempotent::broker::rabbitmq::{ATTEMPTS_HEADER, REASON_HEADER, Runner};
use idempotent::broker::{BrokerError, RunnerStats, Shutdown};
use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use super::{Kind, Order, Shop};

pub fn amqp_url() -> String {
    std::env::var("IDEMPOTENT_AMQP_URL").expect(
        "IDEMPOTENT_AMQP_URL is not set: run the tests with scripts/test, which starts RabbitMQ",
    )
}

/// A fresh durable queue on its own connection.
pub async fn queue() -> (Connection, Channel, String) {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let queue = format!("runner-{}", uuid::Uuid::new_v4().simple());
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    (connection, channel, queue)
}

pub async fn publish(channel: &Channel, queue: &str, id: Option<&str>, kind: Kind) {
    let mut properties = BasicProperties::default().with_delivery_mode(2);
    if let Some(id) = id {
        properties = properties.with_message_id(id.into());
    }
    channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            &Order::payload(kind),
            properties,
        )
        .await
        .unwrap()
        .await
        .unwrap();
}

/// Messages waiting in `queue` (0 if it does not exist yet), asked on a channel of its own: a
/// passive declare of a missing queue closes its channel.
pub async fn depth(connection: &Connection, queue: &str) -> u32 {
    let channel = connection.create_channel().await.unwrap();
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    let depth = declared.map_or(0, |queue| queue.message_count());
    let _ = channel.close(200, "".into()).await;
    depth
}

/// The dead letters in `queue`: (message id, reason, attempts).
pub async fn dead_letters(channel: &Channel, queue: &str) -> Vec<(String, String, i64)> {
    let mut letters = Vec::new();
    while let Some(message) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        let properties = &message.delivery.properties;
        let headers = properties.headers().clone().unwrap_or_default();
        let header = |name: &str| headers.inner().get(name).cloned();
        let reason = match header(REASON_HEADER) {
            Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            other => panic!("no reason header: {other:?}"),
        };
        let attempts = match header(ATTEMPTS_HEADER) {
            Some(AMQPValue::LongLongInt(n)) => n,
            other => panic!("no attempts header: {other:?}"),
        };
        let id = properties
            .message_id()
            .as_ref()
            .map_or(String::new(), |id| id.as_str().to_owned());
        letters.push((id, reason, attempts));
    }
    letters.sort();
    letters
}

/// Starts `runner` in the background with the shop's workers: its shutdown token and its task.
pub fn start(
    runner: Runner,
    shop: &Shop,
) -> (
    Shutdown,
    tokio::task::JoinHandle<Result<RunnerStats, BrokerError>>,
) {
    let shutdown = Shutdown::new();
    let mut workers = (0..16)
        .map(|_| shop.worker())
        .collect::<Vec<_>>()
        .into_iter();
    let running = tokio::spawn(
        runner
            .shutdown_on(shutdown.clone())
            .run(move || workers.next().expect("at most 16 workers")),
    );
    (shutdown, running)
}
