//! What the RabbitMQ producer and consumer examples share: the message, and the AMQP setup.
#![allow(dead_code)]

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};
use serde::{Deserialize, Serialize};

/// The event on the queue. Its stable id travels in the AMQP `message_id` property, which the
/// producer sets once per message and keeps when it retries.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PaymentReceived {
    pub order_id: i64,
    pub amount_cents: i64,
}

/// The URL of the broker: `IDEMPOTENT_AMQP_URL`, or a local RabbitMQ.
pub fn amqp_url() -> String {
    std::env::var("IDEMPOTENT_AMQP_URL").unwrap_or_else(|_| "amqp://127.0.0.1:5672/%2f".into())
}

/// `--name value` from the command line.
pub fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// A channel on a durable queue `queue`.
pub async fn channel(queue: &str) -> Result<(Connection, Channel), lapin::Error> {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await?;
    Ok((connection, channel))
}
