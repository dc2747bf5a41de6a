//! Publishes payment events to NATS JetStream, each with a stable `Nats-Msg-Id`; some of them
//! twice, as a producer does when it retries a publish whose acknowledgement it did not see.
//! (JetStream drops those second publications itself, within the stream's duplicate window.)
//!
//! ```text
//! cargo run --example nats_producer --features nats -- --stream PAYMENTS --messages 40 --retries 8
//! ```

#[path = "nats/common.rs"]
mod common;
#[path = "payments/ledger.rs"]
mod ledger;

use common::streams;
use idempotent::broker::nats::async_nats::{self, HeaderMap};
use ledger::{PaymentReceived, arg};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let stream = arg("--stream").unwrap_or_else(|| "PAYMENTS".into());
    let messages: i64 = arg("--messages").map_or(Ok(10), |v| v.parse())?;
    let retries: i64 = arg("--retries").map_or(Ok(0), |v| v.parse())?;
    let (jetstream, _) = streams(&stream).await?;
    for order_id in 1..=messages {
        let message_id = uuid::Uuid::new_v4().to_string();
        let body = serde_json::to_vec(&PaymentReceived {
            order_id,
            amount_cents: 100 * order_id,
        })?;
        let copies = if order_id <= retries { 2 } else { 1 };
        for _ in 0..copies {
            let mut headers = HeaderMap::new();
            headers.insert(async_nats::header::NATS_MESSAGE_ID, message_id.as_str());
            jetstream
                .publish_with_headers(format!("{stream}.payments"), headers, body.clone().into())
                .await?
                .await?;
        }
    }
    println!("published {messages} messages, {retries} of them twice, to {stream}");
    Ok(())
}
