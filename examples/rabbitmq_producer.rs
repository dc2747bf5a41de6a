//! Publishes payment events to RabbitMQ, each with a stable `message_id` property; some of them
//! twice, as a producer does when it retries a publish whose confirmation it did not see.
//!
//! ```text
//! cargo run --example rabbitmq_producer -- --queue payments --messages 40 --retries 8
//! ```

#[path = "rabbitmq/common.rs"]
mod common;
#[path = "payments/ledger.rs"]
mod ledger;

use common::channel;
use lapin::BasicProperties;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use ledger::{PaymentReceived, arg};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let queue = arg("--queue").unwrap_or_else(|| "payments".into());
    let messages: i64 = arg("--messages").map_or(Ok(10), |v| v.parse())?;
    let retries: i64 = arg("--retries").map_or(Ok(0), |v| v.parse())?;
    let (connection, channel) = channel(&queue).await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    for order_id in 1..=messages {
        let message_id = uuid::Uuid::new_v4().to_string();
        let body = serde_json::to_vec(&PaymentReceived {
            order_id,
            amount_cents: 100 * order_id,
        })?;
        // A retry publishes the same message again, with the same id.
        let copies = if order_id <= retries { 2 } else { 1 };
        for _ in 0..copies {
            channel
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    &body,
                    BasicProperties::default()
                        .with_message_id(message_id.as_str().into())
                        .with_delivery_mode(2),
                )
                .await?
                .await?;
        }
    }
    println!("published {messages} messages, {retries} of them twice, to {queue}");
    connection.close(200, "done".into()).await?;
    Ok(())
}
