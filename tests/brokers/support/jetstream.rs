//! The NATS JetStream side of the runners' tests: streams, consumers, publications, and what is
//! in a stream.

use std::time::Duration;

use futures::StreamExt;
use idempotent::broker::nats::async_nats::jetstream::{self, consumer, stream};
use idempotent::broker::nats::async_nats::{self, HeaderMap};
use idempotent::broker::nats::{ATTEMPTS_HEADER, REASON_HEADER, Runner};
use idempotent::broker::{BrokerError, RunnerStats, Shutdown};

use super::{Kind, Order, Shop};

pub fn nats_url() -> String {
    std::env::var("IDEMPOTENT_NATS_URL").expect(
        "IDEMPOTENT_NATS_URL is not set: run the tests with scripts/test, which starts NATS",
    )
}

/// A fresh stream `S_<id>` on subjects `<id>.>`, with a durable pull consumer of `<id>.orders`
/// and a stream for the dead letters: (context, stream name, subject prefix).
pub async fn setup(ack_wait: Duration) -> (jetstream::Context, consumer::PullConsumer, String) {
    let client = async_nats::connect(nats_url()).await.unwrap();
    let jetstream = jetstream::new(client);
    let id = uuid::Uuid::new_v4().simple().to_string();
    let stream = jetstream
        .create_stream(stream::Config {
            name: format!("S_{id}"),
            subjects: vec![format!("{id}.orders")],
            duplicate_window: Duration::from_secs(60),
            ..Default::default()
        })
        .await
        .unwrap();
    jetstream
        .create_stream(stream::Config {
            name: format!("D_{id}"),
            subjects: vec![format!("{id}.dead")],
            ..Default::default()
        })
        .await
        .unwrap();
    let consumer = stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some("shop".into()),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait,
            ..Default::default()
        })
        .await
        .unwrap();
    (jetstream, consumer, id)
}

pub async fn publish(jetstream: &jetstream::Context, prefix: &str, id: Option<&str>, kind: Kind) {
    let mut headers = HeaderMap::new();
    if let Some(id) = id {
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
    }
    jetstream
        .publish_with_headers(
            format!("{prefix}.orders"),
            headers,
            Order::payload(kind).into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
}

/// Messages of the stream `name`.
pub async fn stored(jetstream: &jetstream::Context, name: &str) -> u64 {
    let mut stream = jetstream.get_stream(name).await.unwrap();
    stream.info().await.unwrap().state.messages
}

/// Messages the consumer has not had acknowledged (pending and in flight).
pub async fn unfinished(consumer: &mut consumer::PullConsumer) -> u64 {
    let info = consumer.info().await.unwrap();
    info.num_pending + info.num_ack_pending as u64
}

/// The dead letters of the test: (message id, reason, attempts).
pub async fn dead_letters(
    jetstream: &jetstream::Context,
    prefix: &str,
) -> Vec<(String, String, u32)> {
    let stream = jetstream.get_stream(format!("D_{prefix}")).await.unwrap();
    let reader = stream
        .create_consumer(consumer::pull::Config {
            deliver_policy: consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut batch = reader
        .fetch()
        .max_messages(100)
        .expires(Duration::from_millis(500))
        .messages()
        .await
        .unwrap();
    let mut letters = Vec::new();
    while let Some(message) = batch.next().await {
        let message = message.unwrap();
        let headers = message.headers.clone().unwrap_or_default();
        let header = |name: &str| headers.get(name).map(|v| v.as_str().to_owned());
        letters.push((
            header(async_nats::header::NATS_MESSAGE_ID.as_ref()).unwrap_or_default(),
            header(REASON_HEADER).expect("a reason"),
            header(ATTEMPTS_HEADER).expect("attempts").parse().unwrap(),
        ));
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
