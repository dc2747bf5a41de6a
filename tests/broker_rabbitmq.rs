//! The RabbitMQ runner against a real broker (`IDEMPOTENT_AMQP_URL`, started by `scripts/test`):
//! retries after a back-off, dead letters with their reason after exactly N attempts, graceful
//! shutdown with deliveries in flight, many workers on one queue. (A consumer SIGKILLed between
//! its commit and its acknowledgement is in `tests/rabbitmq.rs`, on the runner too.)
#![cfg(all(feature = "rabbitmq", feature = "sqlite"))]

mod runner;

use std::time::{Duration, Instant};

use idempotent::broker::rabbitmq::{ATTEMPTS_HEADER, REASON_HEADER, Runner};
use idempotent::broker::{Batches, BeforeSettle, RetryPolicy, Shutdown};
use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use runner::{Kind, Order, Shop, eventually};

fn amqp_url() -> String {
    std::env::var("IDEMPOTENT_AMQP_URL").expect(
        "IDEMPOTENT_AMQP_URL is not set: run the tests with scripts/test, which starts RabbitMQ",
    )
}

/// A fresh durable queue on its own connection.
async fn queue() -> (Connection, Channel, String) {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let queue = format!("runner-{}", uuid::Uuid::new_v4().simple());
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    (connection, channel, queue)
}

async fn publish(channel: &Channel, queue: &str, id: Option<&str>, kind: Kind) {
    let mut properties = BasicProperties::default().with_delivery_mode(2);
    if let Some(id) = id {
        properties = properties.with_message_id(id.into());
    }
    channel
        .basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            &Order::payload(kind),
            properties,
        )
        .await
        .unwrap()
        .await
        .unwrap();
}

/// Messages waiting in `queue` (0 if it does not exist yet), asked on a channel of its own: a
/// passive declare of a missing queue closes its channel.
async fn depth(connection: &Connection, queue: &str) -> u32 {
    let channel = connection.create_channel().await.unwrap();
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    let depth = declared.map_or(0, |queue| queue.message_count());
    let _ = channel.close(200, "".into()).await;
    depth
}

/// The dead letters in `queue`: (message id, reason, attempts).
async fn dead_letters(channel: &Channel, queue: &str) -> Vec<(String, String, i64)> {
    let mut letters = Vec::new();
    while let Some(message) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        let properties = &message.delivery.properties;
        let headers = properties.headers().clone().unwrap_or_default();
        let header = |name: &str| headers.inner().get(name).cloned();
        let reason = match header(REASON_HEADER) {
            Some(AMQPValue::LongString(s)) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
            other => panic!("no reason header: {other:?}"),
        };
        let attempts = match header(ATTEMPTS_HEADER) {
            Some(AMQPValue::LongLongInt(n)) => n,
            other => panic!("no attempts header: {other:?}"),
        };
        let id = properties
            .message_id()
            .as_ref()
            .map_or(String::new(), |id| id.as_str().to_owned());
        letters.push((id, reason, attempts));
    }
    letters.sort();
    letters
}

/// Runs the runner in the background until `done` holds, then shuts it down.
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
    let (connection, channel, queue) = queue().await;
    let shop = Shop::new().await;
    publish(&channel, &queue, Some("flaky"), Kind::Flaky(2)).await;
    let policy = RetryPolicy::new(4, Duration::from_millis(300));
    let runner = Runner::new(channel.clone(), &queue).retry(policy);
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
    assert_eq!(depth(&connection, &queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_is_dead_lettered_with_its_reason_after_exactly_n_attempts_and_nothing_is_lost() {
    let (connection, channel, queue) = queue().await;
    let shop = Shop::new().await;
    for i in 0..20 {
        publish(&channel, &queue, Some(&format!("ok-{i}")), Kind::Ok).await;
    }
    publish(&channel, &queue, Some("poison"), Kind::Poison).await;
    publish(
        &channel,
        &queue,
        Some("always-transient"),
        Kind::AlwaysTransient,
    )
    .await;
    publish(&channel, &queue, None, Kind::Ok).await;
    let policy = RetryPolicy::new(3, Duration::from_millis(100));
    let runner = Runner::new(channel.clone(), &queue)
        .workers(4)
        .retry(policy);
    let dead = runner.dead_letters();
    let stats = run_until(runner, &shop, async || depth(&connection, &dead).await == 3).await;
    let letters = dead_letters(&channel, &dead).await;
    assert_eq!(letters.len(), 3, "{letters:?}");
    let (no_id, reason, attempts) = &letters[0];
    assert_eq!((no_id.as_str(), *attempts), ("", 1));
    assert!(reason.contains("message_id"), "{reason}");
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
    assert_eq!(shop.attempts_of("poison").len(), 1);

    let effects = shop.effects().await;
    assert_eq!(effects.len(), 20, "{effects:?}");
    assert!(effects.values().all(|n| *n == 1));
    assert_eq!((stats.processed, stats.dead_lettered), (20, 3));
    assert_eq!(depth(&connection, &queue).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_deliveries_in_flight_acknowledges_every_commit() {
    let (connection, channel, queue) = queue().await;
    let shop = Shop::new().await;
    const MESSAGES: usize = 24;
    for i in 0..MESSAGES {
        publish(
            &channel,
            &queue,
            Some(&format!("slow-{i}")),
            Kind::Slow(150),
        )
        .await;
    }
    let runner = Runner::new(channel.clone(), &queue).workers(4);
    let first = run_until(runner, &shop, async || !shop.effects().await.is_empty()).await;
    let committed = shop.effects().await.len();
    assert!(
        committed < MESSAGES,
        "the shutdown came too late to test anything"
    );
    // Every committed delivery was acknowledged: what is left in the queue is exactly the rest.
    assert_eq!(
        depth(&connection, &queue).await as usize,
        MESSAGES - committed
    );
    assert_eq!(first.processed as usize, committed);

    // After a restart, nothing committed comes back: no duplicates, each effect once.
    let runner = Runner::new(channel.clone(), &queue).workers(4);
    let second = run_until(runner, &shop, async || {
        shop.effects().await.len() == MESSAGES
    })
    .await;
    assert_eq!(second.duplicates, 0, "a committed delivery was redelivered");
    assert!(shop.effects().await.values().all(|n| *n == 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_workers_on_one_queue_have_each_effect_once() {
    let (connection, channel, queue) = queue().await;
    let shop = Shop::new().await;
    const MESSAGES: usize = 300;
    // A producer that retries a third of its publishes: the same message id twice.
    for i in 0..MESSAGES {
        let id = format!("m-{i}");
        publish(&channel, &queue, Some(&id), Kind::Ok).await;
        if i % 3 == 0 {
            publish(&channel, &queue, Some(&id), Kind::Ok).await;
        }
    }
    let started = Instant::now();
    let runner = Runner::new(channel.clone(), &queue).workers(8);
    let stats = run_until(runner, &shop, async || {
        depth(&connection, &queue).await == 0 && shop.effects().await.len() == MESSAGES
    })
    .await;
    let elapsed = started.elapsed();
    let effects = shop.effects().await;
    assert!(
        effects.values().all(|n| *n == 1),
        "an effect happened twice"
    );
    assert_eq!(stats.processed as usize, MESSAGES);
    assert_eq!(stats.duplicates as usize, MESSAGES.div_ceil(3));
    println!(
        "8 workers: {} deliveries in {elapsed:.2?} ({:.0}/s)",
        stats.processed + stats.duplicates,
        (stats.processed + stats.duplicates) as f64 / elapsed.as_secs_f64()
    );
}

/// Batch mode: one transaction per batch, each delivery settled by its own outcome. A poison
/// message in the middle of a batch is dead-lettered alone, a flaky one retried alone, the others
/// committed and acknowledged once, duplicates (inside the batch and retried publications)
/// acknowledged without running the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_a_failing_message_settles_each_message_by_its_own_outcome() {
    let (connection, channel, queue) = queue().await;
    let shop = Shop::new().await;
    for i in 0..10 {
        publish(&channel, &queue, Some(&format!("b-{i}")), Kind::Ok).await;
    }
    publish(&channel, &queue, Some("poison"), Kind::Poison).await;
    publish(&channel, &queue, Some("flaky"), Kind::Flaky(1)).await;
    for i in 10..20 {
        publish(&channel, &queue, Some(&format!("b-{i}")), Kind::Ok).await;
    }
    publish(&channel, &queue, Some("b-3"), Kind::Ok).await;
    let dead = format!("{queue}.dead");
    let policy = RetryPolicy::new(3, Duration::from_millis(100));
    let runner = Runner::new(channel.clone(), &queue).retry(policy);
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
        shop.effects().await.len() == 21 && depth(&connection, &dead).await == 1
    })
    .await;
    shutdown.cancel();
    let stats = running.await.unwrap().unwrap();
    let effects = shop.effects().await;
    assert!(effects.values().all(|n| *n == 1), "{effects:?}");
    assert!(effects.contains_key("flaky") && !effects.contains_key("poison"));
    let letters = dead_letters(&channel, &dead).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!((letters[0].0.as_str(), letters[0].2), ("poison", 1));
    assert_eq!(shop.attempts_of("flaky").len(), 2);
    assert!(stats.duplicates >= 1, "{stats:?}");
    assert_eq!(
        (stats.processed, stats.retried, stats.dead_lettered),
        (21, 1, 1)
    );
    eventually(Duration::from_secs(5), async || {
        depth(&connection, &queue).await == 0
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
    let (connection, channel, queue) = queue().await;
    let shop = Shop::new().await;
    const MESSAGES: usize = 100;
    for i in 0..MESSAGES {
        publish(&channel, &queue, Some(&format!("c-{i}")), Kind::Ok).await;
    }
    let batches = Batches::new(10, Duration::from_millis(20));
    let mut crashed_batches = 0;
    for _ in 0..3 {
        let crashing = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .unwrap();
        let runner = Runner::new(crashing.create_channel().await.unwrap(), &queue);
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
        drop(crashing); // the broker requeues what was not acknowledged
        crashed_batches += 1;
    }
    let committed_before_crashes = shop.effects().await.len();
    assert!(
        committed_before_crashes >= crashed_batches,
        "{committed_before_crashes}"
    );
    let runner = Runner::new(channel.clone(), &queue);
    let shutdown = Shutdown::new();
    let mut body = Some(shop.batch_body());
    let running = tokio::spawn(runner.shutdown_on(shutdown.clone()).run_batches(
        shop.inbox.clone(),
        "shop",
        batches,
        move || body.take().expect("one worker"),
    ));
    eventually(Duration::from_secs(60), async || {
        shop.effects().await.len() == MESSAGES && depth(&connection, &queue).await == 0
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
