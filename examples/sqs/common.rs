//! What the SQS producer and consumer examples share: the client and the queues.
#![allow(dead_code)]

use std::collections::HashMap;

use idempotent::broker::sqs::aws_sdk_sqs::config::{BehaviorVersion, Credentials, Region};
use idempotent::broker::sqs::aws_sdk_sqs::types::QueueAttributeName;
use idempotent::broker::sqs::aws_sdk_sqs::{self, Client};

/// A client of the SQS at `IDEMPOTENT_SQS_URL` (a local one over plain HTTP, such as the one
/// `scripts/sqs start` starts). Against AWS, make it from your environment instead:
/// `Client::new(&aws_config::load_from_env().await)`, with the `aws-config` crate.
pub fn client() -> Client {
    let endpoint =
        std::env::var("IDEMPOTENT_SQS_URL").unwrap_or_else(|_| "http://127.0.0.1:24566".into());
    let config = aws_sdk_sqs::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .credentials_provider(Credentials::new("local", "local", None, None, "example"))
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    Client::from_conf(config)
}

/// The queue `<name>` of payments, whose redrive policy sends a message to `<name>-dead` after ten
/// receives, with a visibility timeout of `visibility` seconds; both created if missing. Returns
/// the payments queue's URL.
pub async fn queues(
    client: &Client,
    name: &str,
    visibility: u64,
) -> Result<String, Box<dyn std::error::Error>> {
    let dead = client
        .create_queue()
        .queue_name(format!("{name}-dead"))
        .send()
        .await?;
    let dead_arn = client
        .get_queue_attributes()
        .queue_url(dead.queue_url().unwrap_or_default())
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await?
        .attributes()
        .and_then(|attributes| attributes.get(&QueueAttributeName::QueueArn).cloned())
        .ok_or("SQS gave the dead-letter queue no ARN")?;
    let redrive = format!(r#"{{"deadLetterTargetArn":"{dead_arn}","maxReceiveCount":"10"}}"#);
    let payments = client
        .create_queue()
        .queue_name(name)
        .set_attributes(Some(HashMap::from([
            (QueueAttributeName::RedrivePolicy, redrive),
            (
                QueueAttributeName::VisibilityTimeout,
                visibility.to_string(),
            ),
        ])))
        .send()
        .await?;
    Ok(payments.queue_url().unwrap_or_default().to_owned())
}
