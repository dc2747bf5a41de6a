//! The SQS runner against a local SQS (`IDEMPOTENT_SQS_URL`, moto's server, started by
//! `scripts/test`): every message's effect once with duplicates sent, bad input dead-lettered with
//! its reason and everything else flowing; retries after their delay (the visibility timeout);
//! a handler that outlasts the visibility timeout keeps its message from a second runner;
//! shutdown mid-stream hands back what was not started; SQS unreachable mid-stream (a proxy cut)
//! loses and doubles nothing; a dead-letter queue deleted while the runner runs; the queue's
//! redrive policy checked at start; a queue deleted while the runner runs; batch mode; and the
//! outbox's publisher.
#![cfg(all(feature = "sqs", feature = "sqlite"))]

mod support;

use std::collections::HashMap;
use std::time::Duration;

use idempotent::broker::sqs::aws_sdk_sqs::types::QueueAttributeName;
use idempotent::broker::sqs::{OutboxPublisher, Runner};
use idempotent::broker::{Batches, BrokerError, RetryPolicy, RunnerStats, Shutdown};
use idempotent::outbox::{Destination, OutgoingMessage, Publication, PublishError, Publisher};
use support::sqs::{
    Proxy, client, client_at, create, cut_for, dead_letters, depth, queues, send, send_raw,
};
use support::{Kind, Shop, eventually};

/// Runs `runner` with the shop's workers in the background until `done` holds, then shuts it
/// down and returns what it counted.
async fn run_until(runner: Runner, shop: &Shop, done: impl AsyncFnMut() -> bool) -> RunnerStats {
    let shutdown = Shutdown::new();
    let running = tokio::spawn(spawned(runner.shutdown_on(shutdown.clone()), shop));
    eventually(Duration::from_secs(60), done).await;
    shutdown.cancel();
    running.await.unwrap().unwrap()
}

/// The runner's future with the shop's workers (at most 16).
fn spawned(
    runner: Runner,
    shop: &Shop,
) -> impl Future<Output = Result<RunnerStats, BrokerError>> + Send + 'static {
    let mut workers = (0..16)
        .map(|_| shop.worker())
        .collect::<Vec<_>>()
        .into_iter();
    runner.run(move || workers.next().expect("at most 16 workers"))
}

fn quick() -> RetryPolicy {
    RetryPolicy::new(3, Duration::from_secs(1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_once_and_bad_input_dead_lettered_with_its_reason_while_the_rest_flows() {
    let sqs = client();
    let (queue, dead) = queues(&sqs, Duration::from_secs(30), 5).await;
    let shop = Shop::new().await;
    for i in 0..120 {
        send(&sqs, &queue, Some(&format!("ok-{i}")), Kind::Ok).await;
        // One in six sent twice: two SQS messages with one message id.
        if i % 6 == 0 {
            send(&sqs, &queue, Some(&format!("ok-{i}")), Kind::Ok).await;
        }
    }
    send(&sqs, &queue, Some("flaky"), Kind::Flaky(1)).await;
    send(&sqs, &queue, Some("poison"), Kind::Poison).await;
    send(&sqs, &queue, None, Kind::Ok).await;
    send_raw(&sqs, &queue, Some("malformed"), "{not an order").await;
    // Near SQS's limit of 1 MiB: a large body is a body like any other.
    let large = format!(r#"{{"kind":"Ok","padding":"{}"}}"#, "x".repeat(900 * 1024));
    send_raw(&sqs, &queue, Some("large"), &large).await;
    let runner = Runner::new(sqs.clone(), &queue)
        .workers(4)
        .wait_time(Duration::from_secs(1))
        .retry(quick());
    let stats = run_until(runner, &shop, async || depth(&sqs, &queue).await == 0).await;

    let effects = shop.effects().await;
    assert_eq!(effects.len(), 122, "{effects:?}");
    assert!(
        effects.values().all(|n| *n == 1),
        "an effect twice: {effects:?}"
    );
    assert!(effects.contains_key("large") && effects.contains_key("flaky"));
    assert_eq!(shop.attempt_numbers("flaky"), [1, 2]);
    let mut letters = dead_letters(&sqs, &dead).await;
    letters.sort_by(|a, b| a.message_id.cmp(&b.message_id));
    assert_eq!(letters.len(), 3, "{letters:?}");
    assert_eq!(letters[0].message_id, None);
    assert!(letters[0].reason.contains("message-id"), "{:?}", letters[0]);
    assert_eq!(letters[1].message_id.as_deref(), Some("malformed"));
    assert!(
        letters[1].reason.contains("not an order"),
        "{:?}",
        letters[1]
    );
    assert_eq!(letters[1].body, "{not an order");
    assert_eq!(letters[2].message_id.as_deref(), Some("poison"));
    assert!(letters[2].reason.contains("poison"), "{:?}", letters[2]);
    assert_eq!(letters[2].attempts, "1");
    assert_eq!(
        (
            stats.processed,
            stats.duplicates,
            stats.retried,
            stats.dead_lettered
        ),
        (122, 20, 1, 3),
        "{stats:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_comes_back_after_its_delay_and_a_retryable_failure_dead_letters_after_the_last_attempt()
 {
    let sqs = client();
    let (queue, dead) = queues(&sqs, Duration::from_secs(30), 3).await;
    let shop = Shop::new().await;
    send(&sqs, &queue, Some("flaky"), Kind::Flaky(2)).await;
    send(&sqs, &queue, Some("always"), Kind::AlwaysTransient).await;
    let runner = Runner::new(sqs.clone(), &queue)
        .workers(2)
        .wait_time(Duration::from_secs(1))
        .retry(quick());
    let stats = run_until(runner, &shop, async || depth(&sqs, &queue).await == 0).await;
    shop.assert_retried_after("flaky", &[1000, 2000]);
    assert_eq!(shop.effects().await["flaky"], 1);
    let letters = dead_letters(&sqs, &dead).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].message_id.as_deref(), Some("always"));
    assert_eq!(letters[0].attempts, "3");
    assert!(letters[0].reason.contains("3 attempts"), "{:?}", letters[0]);
    assert_eq!(shop.attempt_numbers("always"), [1, 2, 3]);
    assert_eq!(
        (stats.retried, stats.processed, stats.dead_lettered),
        (4, 1, 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_longer_than_the_visibility_timeout_keeps_its_message_from_a_second_runner() {
    let sqs = client();
    let (queue, _dead) = queues(&sqs, Duration::from_secs(2), 5).await;
    let shop = Shop::new().await;
    send(&sqs, &queue, Some("slow"), Kind::Slow(7_000)).await;
    let shutdown = Shutdown::new();
    let first = tokio::spawn(spawned(
        Runner::new(sqs.clone(), &queue)
            .wait_time(Duration::from_secs(1))
            .shutdown_on(shutdown.clone()),
        &shop,
    ));
    eventually(Duration::from_secs(30), async || {
        !shop.attempts_of("slow").is_empty()
    })
    .await;
    // A second runner polls the queue the whole time the first one's handler runs: without the
    // extensions the message is visible again after 2 s, and it runs a second time.
    let second = tokio::spawn(spawned(
        Runner::new(sqs.clone(), &queue)
            .wait_time(Duration::from_secs(1))
            .shutdown_on(shutdown.clone()),
        &shop,
    ));
    eventually(Duration::from_secs(30), async || {
        depth(&sqs, &queue).await == 0
    })
    .await;
    shutdown.cancel();
    let (first, second) = (
        first.await.unwrap().unwrap(),
        second.await.unwrap().unwrap(),
    );
    assert_eq!(
        shop.attempt_numbers("slow"),
        [1],
        "the message was handed out again"
    );
    assert_eq!(shop.effects().await["slow"], 1);
    assert_eq!((first.processed, second.processed), (1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_mid_stream_deletes_every_commit_and_hands_back_the_rest_at_once() {
    let sqs = client();
    // A visibility timeout longer than the test waits: what the first runner held and did not
    // hand back would not come back in time.
    let (queue, _dead) = queues(&sqs, Duration::from_secs(300), 5).await;
    let shop = Shop::new().await;
    const MESSAGES: usize = 40;
    for i in 0..MESSAGES {
        send(&sqs, &queue, Some(&format!("slow-{i}")), Kind::Slow(150)).await;
    }
    let runner = || {
        Runner::new(sqs.clone(), &queue)
            .workers(4)
            .wait_time(Duration::from_secs(1))
    };
    let first = run_until(runner(), &shop, async || !shop.effects().await.is_empty()).await;
    let committed = shop.effects().await.len();
    assert!(
        committed < MESSAGES,
        "the shutdown came too late to test anything"
    );
    assert_eq!(first.processed as usize, committed);
    assert_eq!(depth(&sqs, &queue).await as usize, MESSAGES - committed);
    let second = run_until(runner(), &shop, async || {
        shop.effects().await.len() == MESSAGES
    })
    .await;
    assert_eq!(second.duplicates, 0, "a committed message was not deleted");
    assert!(shop.effects().await.values().all(|n| *n == 1));
    assert_eq!(first.processed + second.processed, MESSAGES as u64);
    eventually(Duration::from_secs(10), async || {
        depth(&sqs, &queue).await == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_unreachable_mid_stream_loses_nothing_doubles_nothing_and_the_runner_comes_back() {
    let sqs = client();
    let (queue, _dead) = queues(&sqs, Duration::from_secs(5), 10).await;
    let shop = Shop::new().await;
    const MESSAGES: usize = 60;
    for i in 0..MESSAGES {
        send(&sqs, &queue, Some(&format!("m-{i}")), Kind::Slow(50)).await;
    }
    let proxy = Proxy::start().await;
    // Without the SDK's own retries: its three jittered attempts could carry every request across
    // a 3 s cut (CI once counted no reconnect), and the runner must see SQS away.
    let through_proxy = aws_sdk_sqs::Client::from_conf(
        client_at(&proxy.endpoint)
            .config()
            .to_builder()
            .retry_config(aws_sdk_sqs::config::retry::RetryConfig::disabled())
            .build(),
    );
    let shutdown = Shutdown::new();
    let running = tokio::spawn(spawned(
        Runner::new(through_proxy, &queue)
            .workers(4)
            .wait_time(Duration::from_secs(1))
            .retry(RetryPolicy::new(10, Duration::from_secs(1)))
            .shutdown_on(shutdown.clone()),
        &shop,
    ));
    eventually(Duration::from_secs(30), async || {
        shop.effects().await.len() >= 10
    })
    .await;
    // Twice: connections cut with requests under way (receives, deletes, visibility changes).
    cut_for(&proxy, Duration::from_secs(3)).await;
    assert!(
        !running.is_finished(),
        "the runner ended while SQS was away"
    );
    eventually(Duration::from_secs(30), async || {
        shop.effects().await.len() >= 30
    })
    .await;
    cut_for(&proxy, Duration::from_secs(3)).await;
    eventually(Duration::from_secs(60), async || {
        depth(&sqs, &queue).await == 0
    })
    .await;
    shutdown.cancel();
    let stats = running.await.unwrap().unwrap();
    let effects = shop.effects().await;
    assert_eq!(effects.len(), MESSAGES, "lost: {effects:?}");
    assert!(effects.values().all(|n| *n == 1), "doubled: {effects:?}");
    assert!(stats.reconnects >= 1, "{stats:?}");
    assert_eq!(stats.dead_lettered, 0, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_queue_deleted_while_the_runner_runs_holds_back_only_its_message() {
    let sqs = client();
    let (queue, dead) = queues(&sqs, Duration::from_secs(30), 50).await;
    let shop = Shop::new().await;
    let stats = {
        let shutdown = Shutdown::new();
        let runner = Runner::new(sqs.clone(), &queue)
            .workers(2)
            .wait_time(Duration::from_secs(1))
            .shutdown_on(shutdown.clone());
        let counted = runner.stats();
        let running = tokio::spawn(spawned(runner, &shop));
        // Once the runner found its dead-letter queue, the queue goes.
        send(&sqs, &queue, Some("first"), Kind::Ok).await;
        eventually(Duration::from_secs(30), async || {
            shop.effects().await.contains_key("first")
        })
        .await;
        sqs.delete_queue().queue_url(&dead).send().await.unwrap();
        send(&sqs, &queue, Some("poison"), Kind::Poison).await;
        for i in 0..20 {
            send(&sqs, &queue, Some(&format!("ok-{i}")), Kind::Ok).await;
        }
        eventually(Duration::from_secs(30), async || {
            shop.effects().await.len() == 21 && counted().released >= 1
        })
        .await;
        // The dead-letter queue is back: the poison goes there on its next attempt.
        let name = dead.rsplit('/').next().unwrap();
        assert_eq!(create(&sqs, name, HashMap::new()).await, dead);
        eventually(Duration::from_secs(30), async || {
            depth(&sqs, &queue).await == 0
        })
        .await;
        shutdown.cancel();
        running.await.unwrap().unwrap()
    };
    let letters = dead_letters(&sqs, &dead).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].message_id.as_deref(), Some("poison"));
    assert!(stats.released >= 1 && stats.dead_lettered == 1, "{stats:?}");
    assert!(shop.effects().await.values().all(|n| *n == 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_without_a_working_redrive_policy_is_refused_at_start() {
    let sqs = client();
    let shop = Shop::new().await;
    let id = uuid::Uuid::new_v4().simple().to_string();
    let bare = create(&sqs, &format!("{id}-bare"), HashMap::new()).await;
    let (low, _) = queues(&sqs, Duration::from_secs(30), 2).await;
    let (gone, dead) = queues(&sqs, Duration::from_secs(30), 5).await;
    sqs.delete_queue().queue_url(&dead).send().await.unwrap();
    for (queue, expected) in [
        (&bare, "no redrive policy"),
        (
            &low,
            "maxReceiveCount is 2, below the retry policy's 3 attempts",
        ),
        (&gone, "does not exist"),
    ] {
        send(&sqs, queue, Some("untouched"), Kind::Ok).await;
        let runner = Runner::new(sqs.clone(), queue.as_str()).retry(quick());
        let refused = tokio::time::timeout(Duration::from_secs(30), spawned(runner, &shop))
            .await
            .expect("the runner waited instead of refusing");
        match refused {
            Err(BrokerError::DeadLetterTarget { target, reason }) => {
                assert_eq!(&target, queue);
                assert!(reason.contains(expected), "{reason}");
            }
            other => panic!("{queue}: {other:?}"),
        }
        // Nothing was received: the message is there, visible.
        assert_eq!(depth(&sqs, queue).await, 1);
    }
    assert!(shop.effects().await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_deleted_while_the_runner_runs_ends_it_with_its_own_error() {
    let sqs = client();
    let (queue, _dead) = queues(&sqs, Duration::from_secs(30), 5).await;
    let shop = Shop::new().await;
    send(&sqs, &queue, Some("first"), Kind::Ok).await;
    let running = tokio::spawn(spawned(
        Runner::new(sqs.clone(), &queue).wait_time(Duration::from_secs(1)),
        &shop,
    ));
    eventually(Duration::from_secs(30), async || {
        shop.effects().await.contains_key("first")
    })
    .await;
    sqs.delete_queue().queue_url(&queue).send().await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .expect("the runner did not notice that its queue is gone")
        .unwrap();
    assert!(
        matches!(&ended, Err(BrokerError::Cancelled { source_name }) if *source_name == queue),
        "{ended:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_settle_each_message_by_its_own_outcome() {
    let sqs = client();
    let (queue, dead) = queues(&sqs, Duration::from_secs(30), 5).await;
    let shop = Shop::new().await;
    for i in 0..25 {
        send(&sqs, &queue, Some(&format!("b-{i}")), Kind::Ok).await;
    }
    send(&sqs, &queue, Some("poison"), Kind::Poison).await;
    send(&sqs, &queue, Some("flaky"), Kind::Flaky(1)).await;
    send(&sqs, &queue, Some("b-3"), Kind::Ok).await;
    let shutdown = Shutdown::new();
    let runner = Runner::new(sqs.clone(), &queue)
        .workers(2)
        .wait_time(Duration::from_secs(1))
        .retry(quick())
        .shutdown_on(shutdown.clone());
    let running = tokio::spawn(runner.run_batches(
        shop.inbox.clone(),
        "shop",
        Batches::new(10, Duration::from_millis(50)),
        {
            let mut bodies = vec![shop.batch_body(), shop.batch_body()];
            move || bodies.pop().expect("two workers")
        },
    ));
    eventually(Duration::from_secs(60), async || {
        depth(&sqs, &queue).await == 0
    })
    .await;
    shutdown.cancel();
    let stats = running.await.unwrap().unwrap();
    let effects = shop.effects().await;
    assert_eq!(effects.len(), 26, "{effects:?}");
    assert!(effects.values().all(|n| *n == 1), "{effects:?}");
    assert!(!effects.contains_key("poison"));
    let letters = dead_letters(&sqs, &dead).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].message_id.as_deref(), Some("poison"));
    assert_eq!(
        (
            stats.processed,
            stats.duplicates,
            stats.retried,
            stats.dead_lettered
        ),
        (26, 1, 1, 1),
        "{stats:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_publisher_carries_the_message_id_and_refuses_what_sqs_cannot_take() {
    let sqs = client();
    let (queue, _dead) = queues(&sqs, Duration::from_secs(30), 5).await;
    let name = queue.rsplit('/').next().unwrap().to_owned();
    let fifo = create(
        &sqs,
        &format!("{name}.fifo"),
        HashMap::from([(QueueAttributeName::FifoQueue, "true".to_owned())]),
    )
    .await;
    let publisher = OutboxPublisher::new(sqs.clone());
    let publication = |id: &str, destination: Destination, payload: &[u8]| {
        let message = OutgoingMessage::new(destination, payload.to_vec())
            .with_header("order-id", id)
            .with_ordering_key("order-7");
        Publication::new(id, &message)
    };
    // By name (looked up once) and by URL.
    publisher
        .publish(&publication(
            "a",
            Destination::queue(&name),
            br#"{"kind":"Ok"}"#,
        ))
        .await
        .unwrap();
    publisher
        .publish(&publication(
            "b",
            Destination::queue(&queue),
            br#"{"kind":"Ok"}"#,
        ))
        .await
        .unwrap();
    // A FIFO queue drops the second publication of one id.
    for _ in 0..2 {
        publisher
            .publish(&publication(
                "c",
                Destination::queue(&fifo),
                br#"{"kind":"Ok"}"#,
            ))
            .await
            .unwrap();
    }
    let shop = Shop::new().await;
    let runner = Runner::new(sqs.clone(), &queue).wait_time(Duration::from_secs(1));
    run_until(runner, &shop, async || shop.effects().await.len() == 2).await;
    assert_eq!(
        shop.effects().await,
        HashMap::from([("a".into(), 1), ("b".into(), 1)])
    );
    assert_eq!(depth(&sqs, &fifo).await, 1);

    let rejected = |outcome: Result<(), PublishError>, expected: &str| match outcome {
        Err(PublishError::Rejected { reason }) => assert!(reason.contains(expected), "{reason}"),
        other => panic!("{other:?}"),
    };
    rejected(
        publisher
            .publish(&publication(
                "d",
                Destination::queue("no-such-queue"),
                b"{}",
            ))
            .await,
        "does not exist",
    );
    rejected(
        publisher
            .publish(&publication("e", Destination::queue(&name), b"\xff\xfe"))
            .await,
        "not UTF-8",
    );
    rejected(
        publisher
            .publish(&publication(
                "f",
                Destination::exchange("shop", &name),
                b"{}",
            ))
            .await,
        "no exchanges",
    );
    let mut crowded = OutgoingMessage::new(Destination::queue(&name), b"{}".to_vec());
    for n in 0..10 {
        crowded = crowded.with_header(format!("h{n}"), "v");
    }
    rejected(
        publisher.publish(&Publication::new("g", &crowded)).await,
        "at most 10 attributes",
    );
    // Too large for SQS: its refusal, not the connection's.
    let huge = "x".repeat(2 * 1024 * 1024);
    rejected(
        publisher
            .publish(&publication(
                "h",
                Destination::queue(&name),
                huge.as_bytes(),
            ))
            .await,
        "",
    );
    // SQS away: unavailable, not a refusal.
    let nowhere =
        OutboxPublisher::new(client_at("http://127.0.0.1:9")).with_timeout(Duration::from_secs(5));
    assert!(matches!(
        nowhere
            .publish(&publication("i", Destination::queue(&queue), b"{}"))
            .await,
        Err(PublishError::Unavailable(_))
    ));
}
