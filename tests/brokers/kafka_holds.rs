//! The Kafka runner's partitions held on failure ([`Runner::hold_partition_on_failure`]), against
//! the Kafka of `tests/brokers/support/kafka.rs`, steered as an operator does, with
//! [`HeldPartitions`]: a record that fails holds its partition (no later record of it runs, the
//! other partitions flow) until it is skipped (dead-lettered with the operator's reason, the rest
//! in order after it) or retried (its next attempt, after retries that waited in place); a hold
//! outlives its runner, and a skip asked while none runs is done by the next; two runners racing
//! over a group with held partitions, one joining mid-stream (a rebalance), run nothing twice and
//! nothing past a hold.
#![cfg(all(feature = "kafka", feature = "sqlite"))]

mod support;

use std::time::Duration;

use idempotent::broker::kafka::{self, Asked, HeldPartitions, Runner};
use idempotent::broker::{BrokerError, RetryPolicy, Shutdown};
use support::kafka::{Kafka, header, spawn};
use support::{Kind, Shop, eventually};

/// A runner that holds partitions on failure, on `topic` in `group`, with a short retry policy.
fn runner(kafka: &Kafka, group: &str, topic: &str) -> Runner {
    Runner::new(kafka.client(), group, &[topic], format!("{topic}.dead"))
        .retry(RetryPolicy::new(3, Duration::from_millis(300)))
        .hold_partition_on_failure()
}

/// The dead letters of `topic`: message id and reason.
async fn dead_letters(kafka: &Kafka, topic: &str) -> Vec<(String, String)> {
    kafka
        .records(&format!("{topic}.dead"))
        .await
        .iter()
        .map(|record| {
            (
                header(record, "message-id").unwrap_or_default(),
                header(record, kafka::REASON_HEADER).unwrap_or_default(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_record_holds_its_partition_until_an_operator_skips_it_and_the_others_flow() {
    let kafka = Kafka::start();
    let topic = kafka.topic("held", 2).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    kafka.produce_to(&topic, 0, "a0", Kind::Ok).await;
    kafka.produce_to(&topic, 0, "bad", Kind::Poison).await;
    kafka.produce_to(&topic, 0, "c0", Kind::Ok).await;
    kafka.produce_to(&topic, 0, "d0", Kind::Ok).await;
    kafka.produce_to(&topic, 1, "a1", Kind::Ok).await;
    let shutdown = Shutdown::new();
    let running = spawn(runner(&kafka, &group, &topic), &shop, 1, &shutdown);
    eventually(Duration::from_secs(60), async || {
        kafka.holds(&group).await.len() == 1 && shop.effects().await.len() == 2
    })
    .await;
    // Partition 1 goes on: one worker takes the partitions in turn, so had partition 0 not been
    // held, c0 would have run before these.
    for i in 0..5 {
        kafka
            .produce_to(&topic, 1, &format!("later-{i}"), Kind::Ok)
            .await;
    }
    eventually(Duration::from_secs(60), async || {
        shop.effects().await.contains_key("later-4")
    })
    .await;
    let effects = shop.effects().await;
    assert!(
        !effects.contains_key("c0") && !effects.contains_key("d0"),
        "a record after the held one ran: {effects:?}"
    );
    let held = kafka.holds(&group).await;
    let hold = &held[0];
    assert_eq!(
        (hold.topic.as_str(), hold.partition, hold.offset),
        (topic.as_str(), 0, 1)
    );
    assert_eq!(hold.message_id.as_deref(), Some("bad"));
    assert!(hold.reason.contains("poison"), "{hold:?}");
    assert_eq!((hold.attempts, hold.asked.clone()), (1, None));
    assert!(
        dead_letters(&kafka, &topic).await.is_empty(),
        "held, not dead-lettered"
    );
    let lag = kafka.lag(&group, &topic).await;
    assert!(
        lag[&0].1.unwrap_or(0) <= 1,
        "partition 0 committed past its held record: {lag:?}"
    );

    let operator = HeldPartitions::new(kafka.client(), &group);
    let asked = operator.skip(&topic, 0, "refunded by hand").await.unwrap();
    assert_eq!(
        asked.asked,
        Some(Asked::Skip {
            reason: "refunded by hand".into()
        })
    );
    eventually(Duration::from_secs(60), async || {
        shop.effects().await.contains_key("d0") && kafka.holds(&group).await.is_empty()
    })
    .await;
    let dead = dead_letters(&kafka, &topic).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0, "bad");
    assert!(
        dead[0]
            .1
            .contains("skipped by an operator: refunded by hand")
            && dead[0].1.contains("poison"),
        "{dead:?}"
    );
    let err = operator.skip(&topic, 0, "again").await.unwrap_err();
    assert!(matches!(err, BrokerError::NotHeld { .. }), "{err}");
    shutdown.cancel();
    let stats = running.await.unwrap().unwrap();
    assert_eq!(
        (stats.held, stats.dead_lettered, stats.processed),
        (1, 1, 9)
    );
    let order = shop.committed_in_order().await;
    let partition_0: Vec<&str> = order
        .iter()
        .map(String::as_str)
        .filter(|id| ["a0", "c0", "d0"].contains(id))
        .collect();
    assert_eq!(partition_0, ["a0", "c0", "d0"]);
    let effects = shop.effects().await;
    assert!(effects.values().all(|count| *count == 1), "{effects:?}");
    assert!(!effects.contains_key("bad"));
    kafka.nothing_left_uncommitted(&group, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_wait_in_place_and_an_operator_retry_runs_the_held_record_as_its_next_attempt() {
    let kafka = Kafka::start();
    let topic = kafka.topic("flaky", 1).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    // Fails its first three attempts: the policy's three, then held.
    kafka.produce_to(&topic, 0, "flaky", Kind::Flaky(3)).await;
    for i in 0..3 {
        kafka
            .produce_to(&topic, 0, &format!("after-{i}"), Kind::Ok)
            .await;
    }
    let shutdown = Shutdown::new();
    let running = spawn(runner(&kafka, &group, &topic), &shop, 2, &shutdown);
    eventually(Duration::from_secs(60), async || {
        kafka.holds(&group).await.len() == 1
    })
    .await;
    shop.assert_retried_after("flaky", &[300, 600]);
    assert!(
        shop.effects().await.is_empty(),
        "a record ran while the one before it was retried"
    );
    assert_eq!(kafka.holds(&group).await[0].attempts, 3);

    HeldPartitions::new(kafka.client(), &group)
        .retry(&topic, 0)
        .await
        .unwrap();
    eventually(Duration::from_secs(60), async || {
        shop.effects().await.len() == 4
    })
    .await;
    assert_eq!(shop.attempt_numbers("flaky"), [1, 2, 3, 4]);
    assert_eq!(
        shop.committed_in_order().await,
        ["flaky", "after-0", "after-1", "after-2"]
    );
    eventually(Duration::from_secs(60), async || {
        kafka.holds(&group).await.is_empty()
    })
    .await;
    shutdown.cancel();
    let stats = running.await.unwrap().unwrap();
    assert_eq!(
        (
            stats.retried,
            stats.held,
            stats.processed,
            stats.dead_lettered
        ),
        (2, 1, 4, 0)
    );
    kafka.nothing_left_uncommitted(&group, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_outlives_its_runner_and_a_skip_asked_while_none_runs_is_done_by_the_next() {
    let kafka = Kafka::start();
    let topic = kafka.topic("outlives", 1).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    for (id, kind) in [("a", Kind::Ok), ("bad", Kind::Poison), ("c", Kind::Ok)] {
        kafka.produce_to(&topic, 0, id, kind).await;
    }
    let shutdown = Shutdown::new();
    let first = spawn(runner(&kafka, &group, &topic), &shop, 1, &shutdown);
    eventually(Duration::from_secs(60), async || {
        kafka.holds(&group).await.len() == 1
    })
    .await;
    shutdown.cancel();
    first.await.unwrap().unwrap();

    // Restarted: the record runs again, and is held again, under a new hold.
    let shutdown = Shutdown::new();
    let second = spawn(runner(&kafka, &group, &topic), &shop, 1, &shutdown);
    let before = kafka.holds(&group).await[0].hold.clone();
    eventually(Duration::from_secs(60), async || {
        kafka
            .holds(&group)
            .await
            .first()
            .is_some_and(|hold| hold.hold != before)
    })
    .await;
    assert_eq!(shop.attempt_numbers("bad"), [1, 1]);
    shutdown.cancel();
    second.await.unwrap().unwrap();
    assert!(!shop.effects().await.contains_key("c"));

    let asked = HeldPartitions::new(kafka.client(), &group)
        .skip(&topic, 0, "no such customer")
        .await
        .unwrap();
    let listed = kafka.holds(&group).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].asked, asked.asked, "the skip waits for a runner");

    let shutdown = Shutdown::new();
    let third = spawn(runner(&kafka, &group, &topic), &shop, 1, &shutdown);
    eventually(Duration::from_secs(60), async || {
        shop.effects().await.contains_key("c") && kafka.holds(&group).await.is_empty()
    })
    .await;
    shutdown.cancel();
    third.await.unwrap().unwrap();
    let dead = dead_letters(&kafka, &topic).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(dead[0].1.contains("no such customer"), "{dead:?}");
    let effects = shop.effects().await;
    assert_eq!(effects.len(), 2, "{effects:?}");
    assert!(effects.values().all(|count| *count == 1), "{effects:?}");
    kafka.nothing_left_uncommitted(&group, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_runners_racing_with_a_rebalance_run_nothing_past_a_hold_and_nothing_twice() {
    let kafka = Kafka::start();
    let topic = kafka.topic("race", 4).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    // 4 partitions of 30 records; partitions 1 and 3 each have a poison record at offset 10, and
    // partition 2 a record with no message id at offset 20.
    for offset in 0..30 {
        for partition in 0..4 {
            let id = format!("p{partition}-{offset:02}");
            match (partition, offset) {
                (1 | 3, 10) => kafka.produce_to(&topic, partition, &id, Kind::Poison).await,
                (2, 20) => kafka.produce_raw_to(&topic, 2, None, b"{}").await,
                _ => {
                    kafka
                        .produce_to(&topic, partition, &id, Kind::Slow(5))
                        .await
                }
            }
        }
    }
    let first_stop = Shutdown::new();
    let first = spawn(runner(&kafka, &group, &topic), &shop, 2, &first_stop);
    eventually(Duration::from_secs(60), async || {
        shop.effects().await.len() >= 20
    })
    .await;
    let second_stop = Shutdown::new();
    let second = spawn(runner(&kafka, &group, &topic), &shop, 2, &second_stop);
    // 30 of partition 0, 10 of 1 and 3, 20 of 2.
    eventually(Duration::from_secs(60), async || {
        shop.effects().await.len() == 70 && kafka.holds(&group).await.len() == 3
    })
    .await;
    let held = kafka.holds(&group).await;
    let at: Vec<(i32, i64)> = held
        .iter()
        .map(|hold| (hold.partition, hold.offset))
        .collect();
    assert_eq!(at, [(1, 10), (2, 20), (3, 10)]);
    assert!(held[1].reason.contains("no message-id header"), "{held:?}");
    let operator = HeldPartitions::new(kafka.client(), &group);
    for hold in &held {
        operator
            .skip(&topic, hold.partition, "bad input")
            .await
            .unwrap();
    }
    // A partition that moved in the rebalance with records in flight is committed by its new
    // owner only after it delivers them again (the inbox drops them), which can come after the
    // last effect: stopping at the last effect would leave them uncommitted.
    eventually(Duration::from_secs(60), async || {
        shop.effects().await.len() == 117
            && kafka.holds(&group).await.is_empty()
            && kafka.all_committed(&group, &topic).await
    })
    .await;
    second_stop.cancel();
    first_stop.cancel();
    let (first, second) = (
        first.await.unwrap().unwrap(),
        second.await.unwrap().unwrap(),
    );
    let effects = shop.effects().await;
    assert!(effects.values().all(|count| *count == 1), "{effects:?}");
    // Each partition's records took effect in their order.
    let order = shop.committed_in_order().await;
    for partition in 0..4 {
        let prefix = format!("p{partition}-");
        let seen: Vec<&String> = order.iter().filter(|id| id.starts_with(&prefix)).collect();
        let mut sorted = seen.clone();
        sorted.sort();
        assert_eq!(seen, sorted, "partition {partition} out of order");
    }
    // The three held records, dead-lettered: once each, or twice where the partition moved
    // between the dead letter and its offset's commit (its next owner skips it again).
    let mut dead: Vec<(i32, i64)> = kafka
        .records(&format!("{topic}.dead"))
        .await
        .iter()
        .map(|record| {
            let at = |name| header(record, name).unwrap().parse::<i64>().unwrap();
            (at(kafka::PARTITION_HEADER) as i32, at(kafka::OFFSET_HEADER))
        })
        .collect();
    let count = (first.dead_lettered + second.dead_lettered) as usize;
    assert_eq!(count, dead.len(), "{dead:?}");
    dead.sort();
    dead.dedup();
    assert_eq!(dead, [(1, 10), (2, 20), (3, 10)]);
    kafka.nothing_left_uncommitted(&group, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_survives_every_broker_down_past_the_session_timeout() {
    let kafka = Kafka::mock();
    let topic = kafka.topic("held-outage", 2).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    for (partition, id, kind) in [
        (0, "a0", Kind::Ok),
        (0, "bad", Kind::Poison),
        (0, "c0", Kind::Ok),
        (1, "a1", Kind::Ok),
    ] {
        kafka.produce_to(&topic, partition, id, kind).await;
    }
    let shutdown = Shutdown::new();
    let running = spawn(runner(&kafka, &group, &topic), &shop, 2, &shutdown);
    eventually(Duration::from_secs(60), async || {
        kafka.holds(&group).await.len() == 1 && shop.effects().await.len() == 2
    })
    .await;
    // Longer than the group's session timeout (6 s): the group forgets the runner.
    kafka.all_down();
    tokio::time::sleep(Duration::from_secs(8)).await;
    kafka.all_up();
    kafka.produce_to(&topic, 1, "b1", Kind::Ok).await;
    eventually(Duration::from_secs(180), async || {
        shop.effects().await.contains_key("b1")
    })
    .await;
    assert!(
        !shop.effects().await.contains_key("c0"),
        "a record after the held one ran after the outage"
    );
    let held = kafka.holds(&group).await;
    assert_eq!(held.len(), 1, "{held:?}");
    HeldPartitions::new(kafka.client(), &group)
        .skip(&topic, 0, "after the outage")
        .await
        .unwrap();
    eventually(Duration::from_secs(60), async || {
        shop.effects().await.contains_key("c0")
    })
    .await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    let effects = shop.effects().await;
    assert!(effects.values().all(|count| *count == 1), "{effects:?}");
    assert_eq!(effects.len(), 4, "{effects:?}");
    kafka.nothing_left_uncommitted(&group, &topic).await;
}
