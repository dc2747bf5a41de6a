//! Sends payment events to an SQS queue, each with a stable id in its `message-id` attribute; some
//! of them twice, as a producer does when it retries a send whose answer it did not see. (SQS
//! keeps both copies of a standard queue's message: the consumer's inbox drops the second.)
//!
//! ```text
//! scripts/sqs start     # a local SQS; prints the IDEMPOTENT_SQS_URL to export
//! cargo run --example sqs_producer --features sqs -- --queue payments --messages 40 --retries 8
//! ```

#[path = "sqs/common.rs"]
mod common;
#[path = "payments/ledger.rs"]
mod ledger;

use common::{client, queues};
use idempotent::broker::sqs::MESSAGE_ID_ATTRIBUTE;
use idempotent::broker::sqs::aws_sdk_sqs::types::{
    MessageAttributeValue, SendMessageBatchRequestEntry,
};
use ledger::{PaymentReceived, arg};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let queue = arg("--queue").unwrap_or_else(|| "payments".into());
    let messages: i64 = arg("--messages").map_or(Ok(10), |v| v.parse())?;
    let retries: i64 = arg("--retries").map_or(Ok(0), |v| v.parse())?;
    let visibility: u64 = arg("--visibility-timeout").map_or(Ok(30), |v| v.parse())?;
    let client = client();
    let url = queues(&client, &queue, visibility).await?;
    // Ten to a request (SendMessageBatch), the copies of a retried message among them.
    let mut entries = Vec::new();
    for order_id in 1..=messages {
        let message_id = MessageAttributeValue::builder()
            .data_type("String")
            .string_value(uuid::Uuid::new_v4().to_string())
            .build()?;
        let body = serde_json::to_string(&PaymentReceived {
            order_id,
            amount_cents: 100 * order_id,
        })?;
        let copies = if order_id <= retries { 2 } else { 1 };
        for copy in 0..copies {
            entries.push(
                SendMessageBatchRequestEntry::builder()
                    .id(format!("{order_id}-{copy}"))
                    .message_body(&body)
                    .message_attributes(MESSAGE_ID_ATTRIBUTE, message_id.clone())
                    .build()?,
            );
        }
    }
    for batch in entries.chunks(10) {
        let sent = client
            .send_message_batch()
            .queue_url(&url)
            .set_entries(Some(batch.to_vec()))
            .send()
            .await?;
        if let Some(failed) = sent.failed().first() {
            return Err(format!("SQS refused a message: {failed:?}").into());
        }
    }
    println!("sent {messages} messages, {retries} of them twice, to {url}");
    Ok(())
}
