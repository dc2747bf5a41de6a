//! A storm of cancellations: every message delivered three times, by more tasks than the pool has
//! connections, each call cut off at a random moment a third of the time (a timeout around the
//! handler) and tried again until it returns; calls from a shared inbox and from workers' inboxes
//! mixed. At the end every message has had its effect exactly once, and the pool still hands out
//! every one of its connections: none was stranded in an unknown state.
//!
//! CI runs a short storm; `IDEMPOTENT_STORM_MESSAGES=2000 cargo test --release --all-features
//! --test inbox_storm` is the long one (the README's figures).
#![cfg(all(feature = "postgres", feature = "sqlite", feature = "mysql"))]

#[path = "../support/mod.rs"]
mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent::Inbox;
use rand::Rng;
use support::mysql::MySqlHarness;
use support::postgres::PgHarness;
use support::sqlite::SqliteHarness;
use support::{Consumer, Delivery, Harness};

const TASKS: usize = 16;
const CONNECTIONS: u32 = 4;
const COPIES: usize = 3;

/// The storm's size: `IDEMPOTENT_STORM_MESSAGES`, 300 by default.
fn messages() -> usize {
    std::env::var("IDEMPOTENT_STORM_MESSAGES").map_or(300, |n| n.parse().expect("a number"))
}

/// Runs the storm on `inbox` (whose pool has `CONNECTIONS` connections) and checks the outcome.
async fn storm<H: Harness>(h: &H, inbox: Inbox<H::Db>) {
    let messages = messages();
    let mut queue: Vec<String> = (0..messages * COPIES)
        .map(|i| format!("storm-{}", i % messages))
        .collect();
    {
        use rand::seq::SliceRandom;
        queue.shuffle(&mut rand::rng());
    }
    let queue = Arc::new(Mutex::new(queue));
    let cancelled = Arc::new(Mutex::new(0usize));
    let tasks = (0..TASKS).map(|task| {
        // Half the tasks are workers keeping their connections between messages.
        let inbox = if task % 2 == 0 {
            inbox.for_worker()
        } else {
            inbox.clone()
        };
        let (queue, cancelled) = (queue.clone(), cancelled.clone());
        async move {
            loop {
                let Some(label) = queue.lock().unwrap().pop() else {
                    return;
                };
                let msg = Delivery::new(&label);
                loop {
                    let cut = rand::rng().random_ratio(1, 3);
                    let call = h.deliver_on(&inbox, Consumer::Savepoints, &msg);
                    let outcome = if cut {
                        let after = Duration::from_micros(rand::rng().random_range(0..3000));
                        match tokio::time::timeout(after, call).await {
                            Ok(outcome) => outcome,
                            Err(_) => {
                                *cancelled.lock().unwrap() += 1;
                                continue;
                            }
                        }
                    } else {
                        call.await
                    };
                    match outcome {
                        Ok(_) => break,
                        Err(error) if error.is_retryable() => {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                        Err(error) => panic!("{label}: a call failed for good: {error:?}"),
                    }
                }
            }
        }
    });
    tokio::time::timeout(Duration::from_secs(600), futures::future::join_all(tasks))
        .await
        .expect("the storm never ended: a connection was stranded, or a call hung");

    let counts = h.effect_counts("savepoints").await;
    assert_eq!(counts.len(), messages, "messages lost");
    let doubled: Vec<_> = counts.iter().filter(|(_, n)| **n != 1).collect();
    assert!(doubled.is_empty(), "effects not exactly once: {doubled:?}");
    let kept = h.effect_counts("savepoint-kept").await;
    assert!(kept.values().all(|n| *n == 1), "a nested commit doubled");
    assert!(h.effect_counts("savepoint-undone").await.is_empty());
    // Every connection of the pool can still be taken at once.
    let all = tokio::time::timeout(
        Duration::from_secs(30),
        futures::future::try_join_all((0..CONNECTIONS).map(|_| inbox.pool().acquire())),
    )
    .await
    .expect("a connection of the pool was stranded");
    assert_eq!(
        all.expect("the pool's connections").len(),
        CONNECTIONS as usize
    );
    eprintln!(
        "storm: {messages} messages x {COPIES}, {TASKS} tasks, {CONNECTIONS} connections, {} calls cut off",
        cancelled.lock().unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storm_on_postgres() {
    let h = PgHarness::new().await;
    storm(&h, h.inbox_with_pool(CONNECTIONS)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storm_on_postgres_with_the_pipelined_claim() {
    let h = PgHarness::new().await;
    storm(&h, h.inbox_with_pool(CONNECTIONS).with_pipelined_claim()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storm_on_mysql() {
    let h = MySqlHarness::new().await;
    storm(&h, h.inbox_with_pool(CONNECTIONS)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn storm_on_sqlite() {
    let h = SqliteHarness::new().await;
    storm(&h, h.inbox_with_pool(CONNECTIONS)).await;
}
