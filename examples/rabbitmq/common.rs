//! What the RabbitMQ producer and consumer examples share: the AMQP setup.
#![allow(dead_code)]

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};

/// The URL of the broker: `IDEMPOTENT_AMQP_URL`, or a local RabbitMQ.
pub fn amqp_url() -> String {
    std::env::var("IDEMPOTENT_AMQP_URL").unwrap_or_else(|_| "amqp://127.0.0.1:5672/%2f".into())
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
