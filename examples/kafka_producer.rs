//! Sends payment events to a Kafka topic, each with a stable id in its `message-id` header and the
//! order's customer as its key (one customer's payments go to one partition, in order); some of
//! them twice, as a producer does when it retries a send whose answer it did not see. (The
//! producer's own idempotence drops only its internal retries: a send made again is a new record,
//! at a new offset, and the consumer's inbox drops it.)
//!
//! ```text
//! KAFKA_BROKERS=127.0.0.1:9092 cargo run --example kafka_producer --features kafka -- \
//!     --topic payments --messages 40 --retries 8
//! ```

#[path = "kafka/common.rs"]
mod common;
#[path = "payments/ledger.rs"]
mod ledger;

use std::time::Duration;

use common::{client, topic};
use idempotent::broker::kafka::MESSAGE_ID_HEADER;
use idempotent::broker::kafka::rdkafka::message::{Header, OwnedHeaders};
use idempotent::broker::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use ledger::{PaymentReceived, arg};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let name = arg("--topic").unwrap_or_else(|| "payments".into());
    let messages: i64 = arg("--messages").map_or(Ok(10), |v| v.parse())?;
    let retries: i64 = arg("--retries").map_or(Ok(0), |v| v.parse())?;
    let partitions: i32 = arg("--partitions").map_or(Ok(4), |v| v.parse())?;
    let client = client();
    topic(&client, &name, partitions).await?;
    let producer: FutureProducer = client
        .clone()
        .set("acks", "all")
        .set("enable.idempotence", "true")
        .create()?;
    // (key, message id, payload) of every send, the copies of a retried message among them.
    let mut records = Vec::new();
    for order_id in 1..=messages {
        let message_id = uuid::Uuid::new_v4().to_string();
        let customer = format!("customer-{}", order_id % 8);
        let payload = serde_json::to_vec(&PaymentReceived {
            order_id,
            amount_cents: 100 * order_id,
        })?;
        let copies = if order_id <= retries { 2 } else { 1 };
        for _ in 0..copies {
            records.push((customer.clone(), message_id.clone(), payload.clone()));
        }
    }
    let sends = records.iter().map(|(customer, message_id, payload)| {
        let headers = OwnedHeaders::new().insert(Header {
            key: MESSAGE_ID_HEADER,
            value: Some(message_id.as_bytes()),
        });
        let record = FutureRecord::to(&name)
            .key(customer)
            .payload(payload)
            .headers(headers);
        producer.send(record, Duration::from_secs(10))
    });
    for sent in futures::future::join_all(sends).await {
        sent.map_err(|(error, _)| error)?;
    }
    println!("sent {messages} messages, {retries} of them twice, to {name}");
    Ok(())
}
