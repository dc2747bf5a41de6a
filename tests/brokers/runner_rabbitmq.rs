//! The RabbitMQ runner against a real broker (`IDEMPOTENT_AMQP_URL`, started by `scripts/test`):
//! retries after a back-off, dead letters with their reason after exactly N attempts, graceful
//! shutdown with deliveries in flight, many workers on one queue; a deleted queue, a dead-letter
//! queue refused at start or deleted while the runner runs, a handler's own `Retryable` error,
//! attempts that count the runner's own retries only, a policy of a hundred attempts. (Broker
//! restarts and a memory alarm are in `tests/brokers/runner_weather.rs`.) (A consumer SIGKILLed between
//! its commit and its acknowledgement is in `tests/brokers/runner_kill.rs`, on the runner too.)
#![cfg(all(feature = "rabbitmq", feature = "sqlite"))]

mod support;

use std::time::{Duration, Instant};

use idempotent::broker::rabbitmq::Runner;
use idempotent::broker::{Batches, BeforeSettle, BrokerError, RetryPolicy, Shutdown};
use lapin::options::{BasicGetOptions, BasicPublishOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use support::amqp::{amqp_url, dead_letters, depth, publish, queue, start};
use support::forging::{Method, forging_acknowledgements};
use support::{Kind, Order, Shop, eventually, eventually_while_running};

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
    shop.assert_retried_after("flaky", &[300, 600]);
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

/// Issue 21: a consumer the broker cancelled (its queue deleted) ended the runner with `Ok`, as a
/// graceful shutdown does. It is an error of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_queue_ends_the_runner_with_its_own_error() {
    let (_connection, channel, queue) = queue().await;
    let shop = Shop::new().await;
    publish(&channel, &queue, Some("first"), Kind::Ok).await;
    let (_shutdown, running) = start(Runner::connect(amqp_url(), &queue), &shop);
    eventually(Duration::from_secs(30), async || {
        shop.effects().await.contains_key("first")
    })
    .await;
    channel
        .queue_delete(queue.as_str().into(), Default::default())
        .await
        .unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(60), running)
        .await
        .expect("the runner ended once its queue was deleted")
        .unwrap();
    match ended {
        Err(BrokerError::Cancelled { source_name }) => assert_eq!(source_name, queue),
        other => panic!("{other:?}"),
    }
}

/// Issue 21: a dead-letter queue the broker refuses to declare stops the runner at start, with an
/// error that names it, before any delivery is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_queue_the_broker_refuses_stops_the_runner_at_start() {
    let (connection, channel, queue) = queue().await;
    let shop = Shop::new().await;
    publish(&channel, &queue, Some("waiting"), Kind::Ok).await;
    // `<queue>.dead` exists already, with arguments the runner's declaration does not have.
    let mut arguments = FieldTable::default();
    arguments.insert("x-max-length".into(), AMQPValue::LongLongInt(10));
    channel
        .queue_declare(
            format!("{queue}.dead").as_str().into(),
            QueueDeclareOptions::durable(),
            arguments,
        )
        .await
        .unwrap();
    let (_shutdown, running) = start(Runner::connect(amqp_url(), &queue), &shop);
    let ended = tokio::time::timeout(Duration::from_secs(60), running)
        .await
        .expect("the runner stopped at start")
        .unwrap();
    match ended {
        Err(BrokerError::DeadLetterTarget { target, .. }) => {
            assert_eq!(target, format!("{queue}.dead"))
        }
        other => panic!("{other:?}"),
    }
    assert!(shop.attempts_of("waiting").is_empty());
    assert_eq!(depth(&connection, &queue).await, 1);
}

/// Issue 21: a dead letter that cannot be published (its queue was deleted while the runner ran,
/// so the copy is unroutable) was acknowledged and lost. It is handed back to the broker after a
/// back-off, again and again, while the other messages flow; once the queue is back, it is
/// dead-lettered there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_that_cannot_be_published_waits_for_redelivery_and_the_rest_flows() {
    let (connection, channel, queue) = queue().await;
    let shop = Shop::new().await;
    let runner = Runner::connect(amqp_url(), &queue).workers(2);
    let dead = runner.dead_letters();
    let stats = runner.stats();
    let (shutdown, running) = start(runner, &shop);
    delete_once_declared(&connection, &channel, &dead, &stats).await;
    publish(&channel, &queue, Some("poison"), Kind::Poison).await;
    for i in 0..20 {
        publish(&channel, &queue, Some(&format!("ok-{i}")), Kind::Ok).await;
    }
    eventually(Duration::from_secs(60), async || {
        shop.effects().await.len() == 20 && stats().released >= 2
    })
    .await;
    assert!(!running.is_finished(), "the runner stopped");
    // The dead-letter queue is back: the poison message gets there.
    declare_again_until_it_holds(&connection, &channel, &dead, 1).await;
    shutdown.cancel();
    let stats = running.await.unwrap().unwrap();
    let letters = dead_letters(&channel, &dead).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].0, "poison");
    assert_eq!(stats.dead_lettered, 1);
    assert_eq!(depth(&connection, &queue).await, 0);
    let effects = shop.effects().await;
    assert!(effects.values().all(|n| *n == 1) && !effects.contains_key("poison"));
}

/// Waits until the runner has declared its dead-letter queue `dead`, then deletes it.
async fn delete_once_declared(
    connection: &Connection,
    channel: &lapin::Channel,
    dead: &str,
    stats: &impl Fn() -> idempotent::broker::RunnerStats,
) {
    eventually(Duration::from_secs(30), async || {
        depth(connection, dead).await == 0 && stats().reconnects == 0 && {
            let probe = connection.create_channel().await.unwrap();
            let exists = probe
                .queue_declare(
                    dead.into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .is_ok();
            let _ = probe.close(200, "".into()).await;
            exists
        }
    })
    .await;
    channel
        .queue_delete(dead.into(), Default::default())
        .await
        .unwrap();
}

/// Declares the dead-letter queue `dead` again, then waits until it holds `letters` messages.
async fn declare_again_until_it_holds(
    connection: &Connection,
    channel: &lapin::Channel,
    dead: &str,
    letters: u32,
) {
    channel
        .queue_declare(
            dead.into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    eventually(Duration::from_secs(120), async || {
        depth(connection, dead).await == letters
    })
    .await;
}

/// RabbitMQ confirms several publications of a channel with one `basic.ack`, and lapin hands a
/// returned message to whichever confirmation it resolves next: with eight workers publishing
/// retries (routed) and dead letters (unroutable: the queue is gone) at once (fewer poison
/// messages than workers: each holds a worker during its back-off), a dead letter's
/// return reached a retry's confirmation, and the poison message was acknowledged as
/// dead-lettered, and lost (2 rounds in 8 under load). No dead letter may count while its queue
/// is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returned_dead_letters_among_retries_in_flight_are_never_taken_for_confirmed() {
    // Each round is one chance for the returns to cross: five of them.
    for _round in 0..5 {
        let (connection, channel, queue) = queue().await;
        let shop = Shop::new().await;
        let runner = Runner::connect(amqp_url(), &queue)
            .workers(8)
            .retry(RetryPolicy::new(3, Duration::from_millis(50)));
        let dead = runner.dead_letters();
        let stats = runner.stats();
        let (shutdown, running) = start(runner, &shop);
        delete_once_declared(&connection, &channel, &dead, &stats).await;
        for i in 0..200 {
            if i % 40 == 0 {
                publish(&channel, &queue, Some(&format!("poison-{i}")), Kind::Poison).await;
            } else {
                publish(
                    &channel,
                    &queue,
                    Some(&format!("flaky-{i}")),
                    Kind::Flaky(1),
                )
                .await;
            }
        }
        eventually(Duration::from_secs(60), async || {
            shop.effects().await.len() == 195 && stats().released >= 5
        })
        .await;
        assert_eq!(
            stats().dead_lettered,
            0,
            "dead letters counted while their queue is missing"
        );
        declare_again_until_it_holds(&connection, &channel, &dead, 5).await;
        shutdown.cancel();
        let stats = running.await.unwrap().unwrap();
        let mut letters: Vec<String> = dead_letters(&channel, &dead)
            .await
            .into_iter()
            .map(|letter| letter.0)
            .collect();
        letters.sort();
        let mut poison: Vec<String> = (0..200)
            .step_by(40)
            .map(|i| format!("poison-{i}"))
            .collect();
        poison.sort();
        assert_eq!(letters, poison);
        assert_eq!((stats.dead_lettered, stats.retried), (5, 195));
        let effects = shop.effects().await;
        assert!(
            effects.values().all(|n| *n == 1) && !effects.keys().any(|k| k.starts_with("poison"))
        );
    }
}

/// A connection that fails during the runner's setup with an error carrying a channel's code
/// (lapin's 406 for an acknowledgement of a publication never sent; a proxy forges one right
/// after the channel enters confirm mode) is a lost connection, not the broker's refusal of the
/// runner's queues: the runner connects again and consumes, instead of ending with an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_failed_in_setup_by_a_forged_acknowledgement_is_made_again() {
    let (_connection, channel, queue) = queue().await;
    let shop = Shop::new().await;
    publish(&channel, &queue, Some("ok"), Kind::Ok).await;
    let url = forging_acknowledgements(&amqp_url(), Method::CONFIRM_SELECT_OK, 1, 1).await;
    let runner = Runner::connect(url, &queue);
    let (shutdown, mut running) = start(runner, &shop);
    eventually_while_running(Duration::from_secs(30), &mut running, async || {
        shop.effects().await.contains_key("ok")
    })
    .await;
    shutdown.cancel();
    let stats = running.await.unwrap().unwrap();
    assert_eq!((stats.processed, stats.reconnects), (1, 1), "{stats:?}");
    assert_eq!(shop.effects().await["ok"], 1);
}

/// Issue 21: `RetryPolicy::new(n, d).max_delay(m)` with `n ≥ 66` made the runner panic at start
/// (it computes every delay to declare its delay queues).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_of_a_hundred_attempts_runs() {
    let (_connection, channel, queue) = queue().await;
    let shop = Shop::new().await;
    publish(&channel, &queue, Some("flaky"), Kind::Flaky(1)).await;
    let policy =
        RetryPolicy::new(100, Duration::from_millis(100)).max_delay(Duration::from_secs(1));
    let runner = Runner::connect(amqp_url(), &queue).retry(policy);
    let stats = run_until(runner, &shop, async || {
        shop.effects().await.contains_key("flaky")
    })
    .await;
    assert_eq!((stats.retried, stats.processed), (1, 1));
}

/// Issue 21: a handler's own transient error (a downstream 503, marked `Retryable`) is retried,
/// in one-message mode and in batch mode; it was dead-lettered at its first attempt in batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retryable_error_of_the_handler_is_retried_in_both_modes() {
    for batches in [false, true] {
        let (connection, channel, queue) = queue().await;
        let shop = Shop::new().await;
        publish(&channel, &queue, Some("flaky-1"), Kind::Unavailable(1)).await;
        publish(&channel, &queue, Some("flaky-2"), Kind::Unavailable(2)).await;
        publish(&channel, &queue, Some("ok"), Kind::Ok).await;
        let policy = RetryPolicy::new(4, Duration::from_millis(100));
        let runner = Runner::connect(amqp_url(), &queue).retry(policy);
        let dead = runner.dead_letters();
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
        assert_eq!(depth(&connection, &dead).await, 0);
    }
}

/// Issue 21: a dead letter moved back to its queue kept the runner's attempt header, and was
/// dead-lettered again after one delivery "after 5 attempts"; a producer could set that header
/// too. Attempts count this runner's own retries only: a message moved back starts again with
/// all its attempts, and a producer's header shortens nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_count_the_runners_own_retries_only() {
    let (connection, channel, queue) = queue().await;
    let shop = Shop::new().await;
    publish(&channel, &queue, Some("failing"), Kind::AlwaysTransient).await;
    // A producer that sets the runner's header itself.
    let mut headers = FieldTable::default();
    headers.insert(
        idempotent::broker::rabbitmq::ATTEMPT_HEADER.into(),
        AMQPValue::LongLongInt(3),
    );
    channel
        .basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions::default(),
            &Order::payload(Kind::Flaky(1)),
            BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id("forged".into())
                .with_headers(headers),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let policy = RetryPolicy::new(3, Duration::from_millis(100));
    let runner = Runner::connect(amqp_url(), &queue).retry(policy);
    let dead = runner.dead_letters();
    let (shutdown, running) = start(runner, &shop);
    eventually(Duration::from_secs(60), async || {
        depth(&connection, &dead).await == 1 && shop.effects().await.contains_key("forged")
    })
    .await;
    assert_eq!(shop.attempt_numbers("forged"), [1, 2]);
    assert_eq!(shop.attempt_numbers("failing"), [1, 2, 3]);

    // An operator moves the dead letter back, headers and all.
    let letter = channel
        .basic_get(dead.as_str().into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
        .expect("the dead letter");
    channel
        .basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions::default(),
            &letter.delivery.data,
            letter.delivery.properties.clone(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    letter
        .delivery
        .ack(lapin::options::BasicAckOptions::default())
        .await
        .unwrap();
    eventually(Duration::from_secs(60), async || {
        depth(&connection, &dead).await == 1 && shop.attempts_of("failing").len() == 6
    })
    .await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    assert_eq!(shop.attempt_numbers("failing"), [1, 2, 3, 1, 2, 3]);
    let letters = dead_letters(&channel, &dead).await;
    assert_eq!(letters.len(), 1);
    assert_eq!((letters[0].0.as_str(), letters[0].2), ("failing", 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_panics_is_dead_lettered_after_its_attempts_and_the_rest_flows() {
    let (connection, channel, queue) = queue().await;
    let shop = Shop::new().await;
    publish(&channel, &queue, Some("panics"), Kind::Panic).await;
    for i in 0..10 {
        publish(&channel, &queue, Some(&format!("ok-{i}")), Kind::Ok).await;
    }
    let policy = RetryPolicy::new(3, Duration::from_millis(100));
    let runner = Runner::new(channel.clone(), &queue)
        .workers(2)
        .retry(policy);
    let stats = run_until(runner, &shop, async || {
        shop.effects().await.len() == 10 && depth(&connection, &format!("{queue}.dead")).await == 1
    })
    .await;
    assert_eq!(shop.attempt_numbers("panics"), [1, 2, 3]);
    let letters = dead_letters(&channel, &format!("{queue}.dead")).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    let (id, reason, attempts) = &letters[0];
    assert_eq!((id.as_str(), *attempts), ("panics", 3));
    assert!(
        reason.contains("the handler panicked: the order book is corrupt"),
        "{reason}"
    );
    assert_eq!(
        (stats.processed, stats.retried, stats.dead_lettered),
        (10, 2, 1)
    );
    assert!(shop.effects().await.values().all(|n| *n == 1));
    assert_eq!(depth(&connection, &queue).await, 0);
}
