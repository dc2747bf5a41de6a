//! The NATS JetStream runner against a real server (`IDEMPOTENT_NATS_URL`, `nats-server -js`,
//! started by `scripts/test`): retries after a back-off (`nak` with a delay), dead letters with
//! their reason after exactly N attempts, graceful shutdown with deliveries in flight, many workers
//! on one consumer; and why JetStream's own duplicate detection does not replace the inbox. Also:
//! consumers without explicit acks refused at start, a dead-letter subject no stream captures
//! (at start, and once its stream is deleted while the runner runs), a handler's own `Retryable`
//! error. (A server restart is in `tests/brokers/runner_weather.rs`.) (A
//! consumer SIGKILLed between its commit and its acknowledgement is in `tests/brokers/runner_kill.rs`.)
#![cfg(all(feature = "nats", feature = "sqlite"))]

mod support;

use std::time::{Duration, Instant};

use futures::StreamExt;
use idempotent::broker::nats::Runner;
use idempotent::broker::nats::async_nats;
use idempotent::broker::nats::async_nats::jetstream::{self, consumer, stream};
use idempotent::broker::{Batches, BeforeSettle, BrokerError, MessageId, RetryPolicy, Shutdown};
use support::jetstream::{dead_letters, nats_url, publish, setup, start, stored, unfinished};
use support::{Incoming, Kind, Shop, eventually};

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
    shop.assert_retried_after("flaky", &[300, 600]);
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
    support::on_order(&shop.inbox, &incoming).await.unwrap()
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

/// Issue 21: on a consumer with `AckPolicy::All`, one worker's acknowledgement settled messages
/// other workers still handled (1,000 messages, 8 kills: 56 lost). The runner refuses every ack
/// policy but `Explicit` at start, before it takes a message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_without_explicit_acks_is_refused_at_start() {
    let (jetstream, mut explicit, prefix) = setup(Duration::from_secs(30)).await;
    let shop = Shop::new().await;
    publish(&jetstream, &prefix, Some("waiting"), Kind::Ok).await;
    let stream = jetstream.get_stream(format!("S_{prefix}")).await.unwrap();
    for (name, policy) in [
        ("all", consumer::AckPolicy::All),
        ("none", consumer::AckPolicy::None),
    ] {
        let consumer: consumer::PullConsumer = stream
            .create_consumer(consumer::pull::Config {
                durable_name: Some(name.into()),
                ack_policy: policy,
                ..Default::default()
            })
            .await
            .unwrap();
        let runner = Runner::new(jetstream.clone(), consumer, format!("{prefix}.dead")).workers(8);
        let (_shutdown, running) = start(runner, &shop);
        let ended = tokio::time::timeout(Duration::from_secs(60), running)
            .await
            .expect("the runner stopped at start")
            .unwrap();
        match ended {
            Err(BrokerError::AckPolicy { found }) => assert_eq!(found, format!("{policy:?}")),
            other => panic!("{other:?}"),
        }
    }
    assert!(shop.attempts_of("waiting").is_empty());
    assert_eq!(unfinished(&mut explicit).await, 1);
}

/// Issue 21: with no stream capturing the dead-letter subject, the runner ended at each poison
/// message (7 times in 17 s). It is found at start, before any message is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_subject_no_stream_captures_stops_the_runner_at_start() {
    let (jetstream, mut consumer, prefix) = setup(Duration::from_secs(30)).await;
    let shop = Shop::new().await;
    publish(&jetstream, &prefix, Some("poison"), Kind::Poison).await;
    let nowhere = format!("{prefix}.nowhere");
    let runner = Runner::new(jetstream.clone(), consumer.clone(), &nowhere);
    let (_shutdown, running) = start(runner, &shop);
    let ended = tokio::time::timeout(Duration::from_secs(60), running)
        .await
        .expect("the runner stopped at start")
        .unwrap();
    match ended {
        Err(BrokerError::DeadLetterTarget { target, .. }) => assert_eq!(target, nowhere),
        other => panic!("{other:?}"),
    }
    assert!(shop.attempts_of("poison").is_empty());
    assert_eq!(unfinished(&mut consumer).await, 1);
}

/// Issue 21: a dead letter that cannot be published (its stream was deleted while the runner
/// ran) ended the runner. The message is `nak`ed with a back-off and the others flow; once a
/// stream captures the subject again, it is dead-lettered there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_that_cannot_be_published_waits_for_redelivery_and_the_rest_flows() {
    let (jetstream, mut consumer, prefix) = setup(Duration::from_secs(30)).await;
    let shop = Shop::new().await;
    let runner = Runner::new(
        jetstream.clone(),
        consumer.clone(),
        format!("{prefix}.dead"),
    )
    .workers(2)
    .publish_timeout(Duration::from_secs(2));
    let stats = runner.stats();
    let (shutdown, running) = start(runner, &shop);
    publish(&jetstream, &prefix, Some("first"), Kind::Ok).await;
    eventually(Duration::from_secs(30), async || {
        shop.effects().await.contains_key("first")
    })
    .await;
    jetstream
        .delete_stream(format!("D_{prefix}"))
        .await
        .unwrap();
    publish(&jetstream, &prefix, Some("poison"), Kind::Poison).await;
    for i in 0..20 {
        publish(&jetstream, &prefix, Some(&format!("ok-{i}")), Kind::Ok).await;
    }
    eventually(Duration::from_secs(60), async || {
        shop.effects().await.len() == 21 && stats().released >= 2
    })
    .await;
    assert!(!running.is_finished(), "the runner stopped");
    jetstream
        .create_stream(stream::Config {
            name: format!("D_{prefix}"),
            subjects: vec![format!("{prefix}.dead")],
            ..Default::default()
        })
        .await
        .unwrap();
    eventually(Duration::from_secs(120), async || {
        stored(&jetstream, &format!("D_{prefix}")).await == 1
    })
    .await;
    shutdown.cancel();
    let stats = running.await.unwrap().unwrap();
    let letters = dead_letters(&jetstream, &prefix).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].0, "poison");
    assert_eq!(stats.dead_lettered, 1);
    let effects = shop.effects().await;
    assert!(effects.values().all(|n| *n == 1) && !effects.contains_key("poison"));
    eventually(Duration::from_secs(10), async || {
        unfinished(&mut consumer).await == 0
    })
    .await;
}

/// Issue 21: a handler's own transient error (a downstream 503, marked `Retryable`) is retried,
/// in one-message mode and in batch mode; it was dead-lettered at its first attempt in batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retryable_error_of_the_handler_is_retried_in_both_modes() {
    for batches in [false, true] {
        let (jetstream, consumer, prefix) = setup(Duration::from_secs(30)).await;
        let shop = Shop::new().await;
        publish(&jetstream, &prefix, Some("flaky-1"), Kind::Unavailable(1)).await;
        publish(&jetstream, &prefix, Some("flaky-2"), Kind::Unavailable(2)).await;
        publish(&jetstream, &prefix, Some("ok"), Kind::Ok).await;
        let policy = RetryPolicy::new(4, Duration::from_millis(100));
        let runner =
            Runner::new(jetstream.clone(), consumer, format!("{prefix}.dead")).retry(policy);
        let shutdown = Shutdown::new();
        let running = if batches {
            let mut body = Some(shop.batch_body());
            tokio::spawn(runner.shutdown_on(shutdown.clone()).run_batches(
                shop.inbox.clone(),
                "shop",
                Batches::new(10, Duration::from_millis(20)),
                move || body.take().expect("one worker"),
            ))
        } else {
            let mut worker = Some(shop.worker());
            tokio::spawn(
                runner
                    .shutdown_on(shutdown.clone())
                    .run(move || worker.take().expect("one worker")),
            )
        };
        eventually(Duration::from_secs(60), async || {
            shop.effects().await.len() == 3
        })
        .await;
        shutdown.cancel();
        let stats = running.await.unwrap().unwrap();
        assert_eq!(
            shop.attempt_numbers("flaky-1"),
            [1, 2],
            "batches: {batches}"
        );
        assert_eq!(
            shop.attempt_numbers("flaky-2"),
            [1, 2, 3],
            "batches: {batches}"
        );
        assert!(shop.effects().await.values().all(|n| *n == 1));
        assert_eq!(
            (stats.processed, stats.retried, stats.dead_lettered),
            (3, 3, 0)
        );
        assert_eq!(stored(&jetstream, &format!("D_{prefix}")).await, 0);
    }
}

/// Issue 21: a consumer the server deleted ends the runner with an error of its own, not `Ok`
/// (which a graceful shutdown returns), and not a wait for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_consumer_ends_the_runner_with_its_own_error() {
    let (jetstream, consumer, prefix) = setup(Duration::from_secs(30)).await;
    let shop = Shop::new().await;
    publish(&jetstream, &prefix, Some("first"), Kind::Ok).await;
    let runner = Runner::new(jetstream.clone(), consumer, format!("{prefix}.dead"));
    let (_shutdown, running) = start(runner, &shop);
    eventually(Duration::from_secs(30), async || {
        shop.effects().await.contains_key("first")
    })
    .await;
    let stream = jetstream.get_stream(format!("S_{prefix}")).await.unwrap();
    stream.delete_consumer("shop").await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(60), running)
        .await
        .expect("the runner ended once its consumer was deleted")
        .unwrap();
    match ended {
        Err(BrokerError::Cancelled { source_name }) => {
            assert_eq!(source_name, format!("S_{prefix}/shop"))
        }
        other => panic!("{other:?}"),
    }
}
