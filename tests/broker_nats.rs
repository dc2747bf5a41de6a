//! The NATS JetStream runner against a real server (`IDEMPOTENT_NATS_URL`, `nats-server -js`,
//! started by `scripts/test`): retries after a back-off (`nak` with a delay), dead letters with
//! their reason after exactly N attempts, graceful shutdown with deliveries in flight, many workers
//! on one consumer; and why JetStream's own duplicate detection does not replace the inbox. (A
//! consumer SIGKILLed between its commit and its acknowledgement is in `tests/nats.rs`.)
#![cfg(all(feature = "nats", feature = "sqlite"))]

mod runner;

use std::time::{Duration, Instant};

use futures::StreamExt;
use idempotent::broker::nats::async_nats::jetstream::{self, consumer, stream};
use idempotent::broker::nats::async_nats::{self, HeaderMap};
use idempotent::broker::nats::{ATTEMPTS_HEADER, REASON_HEADER, Runner};
use idempotent::broker::{Batches, BeforeSettle, MessageId, RetryPolicy, Shutdown};
use runner::{Incoming, Kind, Order, Shop, eventually};

fn nats_url() -> String {
    std::env::var("IDEMPOTENT_NATS_URL").expect(
        "IDEMPOTENT_NATS_URL is not set: run the tests with scripts/test, which starts NATS",
    )
}

/// A fresh stream `S_<id>` on subjects `<id>.>`, with a durable pull consumer of `<id>.orders`
/// and a stream for the dead letters: (context, stream name, subject prefix).
async fn setup(ack_wait: Duration) -> (jetstream::Context, consumer::PullConsumer, String) {
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

async fn publish(jetstream: &jetstream::Context, prefix: &str, id: Option<&str>, kind: Kind) {
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
async fn stored(jetstream: &jetstream::Context, name: &str) -> u64 {
    let mut stream = jetstream.get_stream(name).await.unwrap();
    stream.info().await.unwrap().state.messages
}

/// Messages the consumer has not had acknowledged (pending and in flight).
async fn unfinished(consumer: &mut consumer::PullConsumer) -> u64 {
    let info = consumer.info().await.unwrap();
    info.num_pending + info.num_ack_pending as u64
}

/// The dead letters of the test: (message id, reason, attempts).
async fn dead_letters(jetstream: &jetstream::Context, prefix: &str) -> Vec<(String, String, u32)> {
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

/// Runs a runner in the background until `done` holds, then shuts it down.
async fn run_until(
    runner: Runner,
    shop: &Shop,
    done: impl AsyncFnMut() -> bool,
) -> idempotent::broker::RunnerStats {
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
    eventually(Duration::from_secs(30), done).await;
    shutdown.cancel();
    running.await.unwrap().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retryable_failure_comes_back_after_the_back_off_not_at_once() {
    let (jetstream, consumer, prefix) = setup(Duration::from_secs(30)).await;
    let shop = Shop::new().await;
    publish(&jetstream, &prefix, Some("flaky"), Kind::Flaky(2)).await;
    let policy = RetryPolicy::new(4, Duration::from_millis(300));
    let runner = Runner::new(jetstream.clone(), consumer, format!("{prefix}.dead")).retry(policy);
    let stats = run_until(runner, &shop, async || {
        shop.effects().await.contains_key("flaky")
    })
    .await;
    let attempts = shop.attempts_of("flaky");
    let numbers: Vec<u32> = attempts.iter().map(|a| a.attempt).collect();
    assert_eq!(numbers, [1, 2, 3]);
    for (pair, delay) in attempts.windows(2).zip([300, 600]) {
        let waited = pair[1].at - pair[0].at;
        assert!(
            waited >= Duration::from_millis(delay),
            "attempt {} came {waited:?} after the one before, not after the back-off of {delay} ms",
            pair[1].attempt
        );
    }
    assert_eq!(shop.effects().await["flaky"], 1);
    assert_eq!((stats.retried, stats.processed), (2, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_is_dead_lettered_with_its_reason_after_exactly_n_attempts_and_nothing_is_lost() {
    let (jetstream, mut consumer, prefix) = setup(Duration::from_secs(30)).await;
    let shop = Shop::new().await;
    for i in 0..20 {
        publish(&jetstream, &prefix, Some(&format!("ok-{i}")), Kind::Ok).await;
    }
    publish(&jetstream, &prefix, Some("poison"), Kind::Poison).await;
    publish(
        &jetstream,
        &prefix,
        Some("always-transient"),
        Kind::AlwaysTransient,
    )
    .await;
    publish(&jetstream, &prefix, None, Kind::Ok).await;
    let policy = RetryPolicy::new(3, Duration::from_millis(100));
    let runner = Runner::new(
        jetstream.clone(),
        consumer.clone(),
        format!("{prefix}.dead"),
    )
    .workers(4)
    .retry(policy);
    let stats = run_until(runner, &shop, async || {
        stored(&jetstream, &format!("D_{prefix}")).await == 3
    })
    .await;
    let letters = dead_letters(&jetstream, &prefix).await;
    assert_eq!(letters.len(), 3, "{letters:?}");
    let (no_id, reason, attempts) = &letters[0];
    assert_eq!((no_id.as_str(), *attempts), ("", 1));
    assert!(reason.contains("Nats-Msg-Id"), "{reason}");
    let (id, reason, attempts) = &letters[1];
    assert_eq!((id.as_str(), *attempts), ("always-transient", 3));
    assert!(
        reason.contains("3 attempts") && reason.contains("unavailable"),
        "{reason}"
    );
    let (id, reason, attempts) = &letters[2];
    assert_eq!((id.as_str(), *attempts), ("poison", 1));
    assert!(reason.contains("poison"), "{reason}");
    assert_eq!(shop.attempts_of("always-transient").len(), 3);

    let effects = shop.effects().await;
    assert_eq!(effects.len(), 20, "{effects:?}");
    assert!(effects.values().all(|n| *n == 1));
    assert_eq!((stats.processed, stats.dead_lettered), (20, 3));
    eventually(Duration::from_secs(5), async || {
        unfinished(&mut consumer).await == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_deliveries_in_flight_acknowledges_every_commit() {
    let (jetstream, mut consumer, prefix) = setup(Duration::from_secs(30)).await;
    let shop = Shop::new().await;
    const MESSAGES: usize = 24;
    for i in 0..MESSAGES {
        publish(
            &jetstream,
            &prefix,
            Some(&format!("slow-{i}")),
            Kind::Slow(150),
        )
        .await;
    }
    let dead = format!("{prefix}.dead");
    let runner = Runner::new(jetstream.clone(), consumer.clone(), &dead).workers(4);
    let first = run_until(runner, &shop, async || !shop.effects().await.is_empty()).await;
    let committed = shop.effects().await.len();
    assert!(
        committed < MESSAGES,
        "the shutdown came too late to test anything"
    );
    assert_eq!(first.processed as usize, committed);
    // Every committed delivery was acknowledged; the rest is pending again at once.
    let left = unfinished(&mut consumer).await;
    assert_eq!(left as usize, MESSAGES - committed);

    let runner = Runner::new(jetstream.clone(), consumer.clone(), &dead).workers(4);
    let second = run_until(runner, &shop, async || {
        shop.effects().await.len() == MESSAGES
    })
    .await;
    assert_eq!(second.duplicates, 0, "a committed delivery was redelivered");
    assert!(shop.effects().await.values().all(|n| *n == 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_workers_on_one_consumer_have_each_effect_once() {
    let (jetstream, mut consumer, prefix) = setup(Duration::from_secs(30)).await;
    let shop = Shop::new().await;
    const MESSAGES: usize = 300;
    for i in 0..MESSAGES {
        publish(&jetstream, &prefix, Some(&format!("m-{i}")), Kind::Ok).await;
    }
    let started = Instant::now();
    let runner = Runner::new(
        jetstream.clone(),
        consumer.clone(),
        format!("{prefix}.dead"),
    )
    .workers(8);
    let stats = run_until(runner, &shop, async || {
        shop.effects().await.len() == MESSAGES
    })
    .await;
    let elapsed = started.elapsed();
    assert!(shop.effects().await.values().all(|n| *n == 1));
    assert_eq!(stats.processed as usize, MESSAGES);
    eventually(Duration::from_secs(5), async || {
        unfinished(&mut consumer).await == 0
    })
    .await;
    println!(
        "8 workers: {MESSAGES} deliveries in {elapsed:.2?} ({:.0}/s)",
        MESSAGES as f64 / elapsed.as_secs_f64()
    );
}

/// JetStream drops a second *publication* of a message id within the stream's duplicate window,
/// but a *redelivery* of the one stored message to a consumer (a crash before the ack, an
/// `ack_wait` that ran out) is a second delivery all the same: only the inbox makes it a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_deduplicates_publications_not_redeliveries() {
    let (jetstream, consumer, prefix) = setup(Duration::from_secs(1)).await;
    let shop = Shop::new().await;
    publish(&jetstream, &prefix, Some("once"), Kind::Ok).await;
    publish(&jetstream, &prefix, Some("once"), Kind::Ok).await; // a producer's retry
    assert_eq!(stored(&jetstream, &format!("S_{prefix}")).await, 1);

    let mut messages = consumer.messages().await.unwrap();
    let mut outcomes = Vec::new();
    for _ in 0..2 {
        // Handled and committed, then never acknowledged (the consumer "crashed"): JetStream
        // delivers it again once `ack_wait` has run out.
        let message = messages.next().await.unwrap().unwrap();
        let incoming = Incoming {
            message_id: MessageId(
                message
                    .headers
                    .as_ref()
                    .unwrap()
                    .get(async_nats::header::NATS_MESSAGE_ID)
                    .unwrap()
                    .as_str()
                    .to_owned(),
            ),
            order: serde_json::from_slice(&message.payload).unwrap(),
            attempt: 1,
        };
        outcomes.push(shop_handle(&shop, incoming).await);
    }
    assert!(outcomes[0].is_processed());
    assert!(
        outcomes[1].is_duplicate(),
        "the redelivery ran the handler again"
    );
    assert_eq!(shop.effects().await["once"], 1);
}

async fn shop_handle(shop: &Shop, incoming: Incoming) -> idempotent::Handled<()> {
    runner::on_order(&shop.inbox, &incoming).await.unwrap()
}

/// Batch mode: one transaction per batch, each delivery settled by its own outcome. A poison
/// message in the middle of a batch is dead-lettered alone, a flaky one retried alone, the others
/// committed and acknowledged once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_a_failing_message_settles_each_message_by_its_own_outcome() {
    let (jetstream, mut consumer, prefix) = setup(Duration::from_secs(30)).await;
    let shop = Shop::new().await;
    for i in 0..10 {
        publish(&jetstream, &prefix, Some(&format!("b-{i}")), Kind::Ok).await;
    }
    publish(&jetstream, &prefix, Some("poison"), Kind::Poison).await;
    publish(&jetstream, &prefix, Some("flaky"), Kind::Flaky(1)).await;
    for i in 10..20 {
        publish(&jetstream, &prefix, Some(&format!("b-{i}")), Kind::Ok).await;
    }
    publish(&jetstream, &prefix, Some("b-3"), Kind::Ok).await;
    let policy = RetryPolicy::new(3, Duration::from_millis(100));
    let runner = Runner::new(
        jetstream.clone(),
        consumer.clone(),
        format!("{prefix}.dead"),
    )
    .retry(policy);
    let shutdown = Shutdown::new();
    let running = tokio::spawn(runner.shutdown_on(shutdown.clone()).run_batches(
        shop.inbox.clone(),
        "shop",
        Batches::new(50, Duration::from_millis(50)),
        {
            let body = shop.batch_body();
            let mut bodies = Some(body);
            move || bodies.take().expect("one worker")
        },
    ));
    eventually(Duration::from_secs(30), async || {
        shop.effects().await.len() == 21 && stored(&jetstream, &format!("D_{prefix}")).await == 1
    })
    .await;
    shutdown.cancel();
    let stats = running.await.unwrap().unwrap();
    let effects = shop.effects().await;
    assert!(effects.values().all(|n| *n == 1), "{effects:?}");
    assert!(effects.contains_key("flaky") && !effects.contains_key("poison"));
    let letters = dead_letters(&jetstream, &prefix).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!((letters[0].0.as_str(), letters[0].2), ("poison", 1));
    assert_eq!(shop.attempts_of("flaky").len(), 2);
    // JetStream itself dropped the retried publication of b-3 (the same Nats-Msg-Id).
    assert_eq!(stats.duplicates, 0, "{stats:?}");
    assert_eq!(
        (stats.processed, stats.retried, stats.dead_lettered),
        (21, 1, 1)
    );
    eventually(Duration::from_secs(5), async || {
        unfinished(&mut consumer).await == 0
    })
    .await;
}

/// Batch mode with a crash between a batch's commit and its acknowledgements, three times: the
/// runner stops for good before it settles the first delivery of a committed batch (its
/// `before_settle` hook never returns), and is dropped with its connection, as a process that
/// dies there. Every message of the crashed batches comes back and is found to be a duplicate;
/// every effect happens once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_crashed_between_commit_and_ack_have_each_effect_once() {
    let (jetstream, mut consumer, prefix) = setup(Duration::from_secs(1)).await;
    let shop = Shop::new().await;
    const MESSAGES: usize = 100;
    for i in 0..MESSAGES {
        publish(&jetstream, &prefix, Some(&format!("c-{i}")), Kind::Ok).await;
    }
    let dead = format!("{prefix}.dead");
    let batches = Batches::new(10, Duration::from_millis(20));
    let mut crashed_batches = 0;
    for _ in 0..3 {
        let client = async_nats::connect(nats_url()).await.unwrap();
        let crashing = jetstream::new(client.clone());
        let stream = crashing.get_stream(format!("S_{prefix}")).await.unwrap();
        let on_crashing: consumer::PullConsumer = stream.get_consumer("shop").await.unwrap();
        let runner = Runner::new(crashing, on_crashing, &dead);
        let (committed, mut told) = tokio::sync::mpsc::channel(1);
        let hook: BeforeSettle = std::sync::Arc::new(move |_, _| {
            let committed = committed.clone();
            Box::pin(async move {
                let _ = committed.try_send(());
                std::future::pending::<()>().await // the process "dies" here
            })
        });
        let mut body = Some(shop.batch_body());
        let running = tokio::spawn(runner.before_settle(hook).run_batches(
            shop.inbox.clone(),
            "shop",
            batches,
            move || body.take().expect("one worker"),
        ));
        tokio::time::timeout(Duration::from_secs(30), told.recv())
            .await
            .expect("a batch was committed");
        running.abort();
        let _ = running.await;
        drop(client); // what was not acknowledged comes back after ack_wait
        crashed_batches += 1;
    }
    let committed_before_crashes = shop.effects().await.len();
    assert!(
        committed_before_crashes >= crashed_batches,
        "{committed_before_crashes}"
    );
    let runner = Runner::new(jetstream.clone(), consumer.clone(), &dead);
    let shutdown = Shutdown::new();
    let mut body = Some(shop.batch_body());
    let running = tokio::spawn(runner.shutdown_on(shutdown.clone()).run_batches(
        shop.inbox.clone(),
        "shop",
        batches,
        move || body.take().expect("one worker"),
    ));
    eventually(Duration::from_secs(60), async || {
        shop.effects().await.len() == MESSAGES && unfinished(&mut consumer).await == 0
    })
    .await;
    shutdown.cancel();
    let stats = running.await.unwrap().unwrap();
    let effects = shop.effects().await;
    assert!(
        effects.values().all(|n| *n == 1),
        "an effect happened twice"
    );
    // Every message committed before a crash came back unacknowledged, and was a duplicate.
    assert_eq!(stats.duplicates as usize, committed_before_crashes);
    assert_eq!(
        stats.processed as usize,
        MESSAGES - committed_before_crashes
    );
}
