//! What the NATS producer and consumer examples share: the JetStream setup.
#![allow(dead_code)]

use std::time::Duration;

use idempotent::broker::nats::async_nats;
use idempotent::broker::nats::async_nats::jetstream::{self, consumer, stream};

/// The URL of the server: `IDEMPOTENT_NATS_URL`, or a local NATS.
pub fn nats_url() -> String {
    std::env::var("IDEMPOTENT_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// The stream `<name>` of payments on `<name>.payments`, which drops a second publication of a
/// `Nats-Msg-Id` within two minutes, and the stream `<name>_DEAD` of dead letters on
/// `<name>.dead`; both created if missing.
pub async fn streams(
    name: &str,
) -> Result<(jetstream::Context, stream::Stream), Box<dyn std::error::Error>> {
    let client = async_nats::connect(nats_url()).await?;
    let jetstream = jetstream::new(client);
    let payments = jetstream
        .get_or_create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![format!("{name}.payments")],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await?;
    jetstream
        .get_or_create_stream(stream::Config {
            name: format!("{name}_DEAD"),
            subjects: vec![format!("{name}.dead")],
            ..Default::default()
        })
        .await?;
    Ok((jetstream, payments))
}

/// The durable pull consumer `ledger` of the payments stream, which redelivers a message not
/// acknowledged within `ack_wait`.
pub async fn ledger_consumer(
    payments: &stream::Stream,
    ack_wait: Duration,
) -> Result<consumer::PullConsumer, Box<dyn std::error::Error>> {
    Ok(payments
        .get_or_create_consumer(
            "ledger",
            consumer::pull::Config {
                durable_name: Some("ledger".into()),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait,
                ..Default::default()
            },
        )
        .await?)
}
