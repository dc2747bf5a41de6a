//! What the Kafka producer and consumer examples share: the client settings and the topic.
#![allow(dead_code)]

use std::time::Duration;

use idempotent::broker::kafka::ClientConfig;
use idempotent::broker::kafka::rdkafka::admin::{
    AdminClient, AdminOptions, NewTopic, TopicReplication,
};
use idempotent::broker::kafka::rdkafka::client::DefaultClientContext;
use idempotent::broker::kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use idempotent::broker::kafka::rdkafka::types::RDKafkaErrorCode;

/// The client settings of the cluster at `KAFKA_BROKERS` (default `127.0.0.1:9092`).
pub fn client() -> ClientConfig {
    let brokers = std::env::var("KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let mut client = ClientConfig::new();
    client.set("bootstrap.servers", brokers);
    client
}

/// Makes the topic `name` with `partitions` partitions, unless the cluster has it.
pub async fn topic(
    client: &ClientConfig,
    name: &str,
    partitions: i32,
) -> Result<(), Box<dyn std::error::Error>> {
    let probe: BaseConsumer = client.create()?;
    let wanted = name.to_owned();
    let known = tokio::task::spawn_blocking(move || {
        probe
            .fetch_metadata(Some(&wanted), Duration::from_secs(10))
            .map(|metadata| {
                metadata
                    .topics()
                    .iter()
                    .any(|topic| topic.error().is_none() && !topic.partitions().is_empty())
            })
    })
    .await??;
    if known {
        return Ok(());
    }
    let admin: AdminClient<DefaultClientContext> = client.create()?;
    let made = admin
        .create_topics(
            &[NewTopic::new(name, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
        )
        .await?;
    for result in made {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => return Err(format!("topic {topic}: {code}").into()),
        }
    }
    Ok(())
}
