//! What an adversarial run of [`Runner::hold_partition_on_failure`] from its public API tried,
//! against the Kafka of `tests/brokers/support/kafka.rs`: an operator who spams retries, or asks a
//! retry and a skip of one hold at once; garbage on the group's holds topic (no key, keys that are
//! not UTF-8 or name no partition, commands for partitions that do not exist or holds that were
//! never announced, an unknown command, a 900 KB reason) and a reason too large to send; the
//! broker refusing the hold's announcement; every broker down while a partition is held; sixteen
//! partitions held at once (poison records and panicking handlers); and batch mode. Each asserts
//! what matters: every effect once, each partition in order, nothing after a hold before its skip
//! or retry, the dead letters with the operator's reasons, and nothing left uncommitted.
#![cfg(all(feature = "kafka", feature = "sqlite"))]

#[path = "../brokers/support/mod.rs"]
mod support;

use std::collections::HashMap;

use futures::StreamExt as _;
use std::time::Duration;

use idempotent::broker::kafka::rdkafka::message::{Header, OwnedHeaders};
use idempotent::broker::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idempotent::broker::kafka::{self, HeldPartition, HeldPartitions, Runner};
use idempotent::broker::{BrokerError, RetryPolicy, Shutdown};
use support::kafka::{Kafka, header, spawn, spawn_batches};
use support::{Kind, Shop, eventually};

const LIMIT: Duration = Duration::from_secs(60);

/// A runner that holds partitions on failure, on `topic` in `group`, with a short retry policy.
fn runner(kafka: &Kafka, group: &str, topic: &str) -> Runner {
    Runner::new(kafka.client(), group, &[topic], format!("{topic}.dead"))
        .retry(RetryPolicy::new(3, Duration::from_millis(100)))
        .hold_partition_on_failure()
}

/// The holds of `group` now, `None` while the cluster does not answer.
async fn try_holds(kafka: &Kafka, group: &str) -> Option<Vec<HeldPartition>> {
    match HeldPartitions::new(kafka.client(), group).list().await {
        Ok(holds) => Some(holds),
        Err(BrokerError::NotHeld { .. }) => Some(Vec::new()),
        Err(_) => None,
    }
}

/// The dead letters of `topic`: partition, offset, message id and reason.
async fn dead_letters(kafka: &Kafka, topic: &str) -> Vec<(i32, i64, String, String)> {
    kafka
        .records(&format!("{topic}.dead"))
        .await
        .iter()
        .map(|record| {
            let text = |name| header(record, name).unwrap_or_default();
            (
                text(kafka::PARTITION_HEADER).parse().unwrap(),
                text(kafka::OFFSET_HEADER).parse().unwrap(),
                text("message-id"),
                text(kafka::REASON_HEADER),
            )
        })
        .collect()
}

/// Asserts that every effect happened once, and that the records of each partition whose ids
/// start with `p<n>-` took effect in their order (their ids sort in offset order).
async fn once_each_and_in_order(shop: &Shop) {
    let effects = shop.effects().await;
    assert!(effects.values().all(|count| *count == 1), "{effects:?}");
    let order = shop.committed_in_order().await;
    let mut by_partition: HashMap<&str, Vec<&String>> = HashMap::new();
    for id in &order {
        let partition = id.split('-').next().unwrap();
        by_partition.entry(partition).or_default().push(id);
    }
    for (partition, seen) in by_partition {
        let mut sorted = seen.clone();
        sorted.sort();
        assert_eq!(seen, sorted, "partition {partition} out of order");
    }
}

/// Asserts that `group` has not committed past `offset` of `partition` of `topic`.
async fn not_committed_past(kafka: &Kafka, group: &str, topic: &str, partition: i32, offset: i64) {
    let lag = kafka.lag(group, topic).await;
    assert!(
        lag[&partition].1.unwrap_or(0) <= offset,
        "partition {partition} committed past its held record at {offset}: {lag:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_retries_at_once_run_the_record_once_per_hold_and_it_takes_effect_once() {
    let kafka = Kafka::start();
    let topic = kafka.topic("spam", 2).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    // Fails its first five attempts: three in place, then held; held again after the operator's
    // first retry (its fourth) and second (its fifth); its sixth succeeds.
    kafka.produce_to(&topic, 0, "p0-0", Kind::Flaky(5)).await;
    for i in 1..6 {
        kafka
            .produce_to(&topic, 0, &format!("p0-{i}"), Kind::Ok)
            .await;
    }
    let shutdown = Shutdown::new();
    let running = spawn(runner(&kafka, &group, &topic), &shop, 2, &shutdown);
    eventually(LIMIT, async || kafka.holds(&group).await.len() == 1).await;
    let operator = HeldPartitions::new(kafka.client(), &group);
    // Fifty operators retry at once, and again while it is not done: each retry names the hold
    // it listed, and a hold is retried once.
    let mut rounds = 0;
    while !shop.effects().await.contains_key("p0-0") {
        rounds += 1;
        assert!(
            rounds < 20,
            "not taken effect after {rounds} rounds of retries"
        );
        let asked: Vec<_> = futures::stream::iter((0..50).map(|_| operator.retry(&topic, 0)))
            .buffer_unordered(10)
            .collect()
            .await;
        for answer in asked {
            match answer {
                Ok(_) | Err(BrokerError::NotHeld { .. }) => {}
                Err(error) => panic!("a retry failed: {error}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eventually(LIMIT, async || {
        shop.effects().await.len() == 6 && kafka.holds(&group).await.is_empty()
    })
    .await;
    assert_eq!(
        shop.attempt_numbers("p0-0"),
        [1, 2, 3, 4, 5, 6],
        "each hold ran once more, however many retries named it"
    );
    shutdown.cancel();
    let stats = running.await.unwrap().unwrap();
    assert_eq!((stats.processed, stats.dead_lettered), (6, 0));
    assert_eq!(stats.held, 3, "held after attempts 3, 4 and 5: {stats:?}");
    once_each_and_in_order(&shop).await;
    assert!(dead_letters(&kafka, &topic).await.is_empty());
    kafka.nothing_left_uncommitted(&group, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_and_a_skip_of_one_hold_at_once_run_it_or_dead_letter_it_never_both() {
    let kafka = Kafka::start();
    let topic = kafka.topic("both", 4).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    // Each partition's first record fails its first three attempts and is held; its fourth (an
    // operator's retry) succeeds.
    for partition in 0..4 {
        let id = format!("p{partition}-0");
        kafka
            .produce_to(&topic, partition, &id, Kind::Flaky(3))
            .await;
        for i in 1..4 {
            let id = format!("p{partition}-{i}");
            kafka.produce_to(&topic, partition, &id, Kind::Ok).await;
        }
    }
    let shutdown = Shutdown::new();
    let running = spawn(runner(&kafka, &group, &topic), &shop, 2, &shutdown);
    eventually(LIMIT, async || kafka.holds(&group).await.len() == 4).await;
    assert!(shop.effects().await.is_empty(), "nothing passed a hold");
    let operator = HeldPartitions::new(kafka.client(), &group);
    // Partitions 0 and 1: retry and skip at once; 2: retry then skip; 3: skip then retry.
    for partition in 0..2 {
        let (retried, skipped) = tokio::join!(
            operator.retry(&topic, partition),
            operator.skip(&topic, partition, "both at once")
        );
        for answer in [retried, skipped] {
            assert!(
                matches!(answer, Ok(_) | Err(BrokerError::NotHeld { .. })),
                "{answer:?}"
            );
        }
    }
    operator.retry(&topic, 2).await.unwrap();
    let _ = operator.skip(&topic, 2, "retry then skip").await;
    operator.skip(&topic, 3, "skip then retry").await.unwrap();
    let _ = operator.retry(&topic, 3).await;
    // Each first record either took effect or was dead-lettered, and the rest followed.
    eventually(LIMIT, async || {
        let effects = shop.effects().await;
        let rest = (0..4).all(|p| (1..4).all(|i| effects.contains_key(&format!("p{p}-{i}"))));
        rest && kafka.holds(&group).await.is_empty()
    })
    .await;
    let effects = shop.effects().await;
    let dead = dead_letters(&kafka, &topic).await;
    for partition in 0..4 {
        let id = format!("p{partition}-0");
        let ran = effects.contains_key(&id);
        let dead_lettered = dead.iter().filter(|letter| letter.2 == id).count();
        assert!(
            ran != (dead_lettered == 1) && dead_lettered <= 1,
            "{id}: ran {ran}, dead-lettered {dead_lettered} times: {dead:?}"
        );
    }
    let skipped = dead.iter().find(|letter| letter.2 == "p3-0");
    assert!(
        skipped.is_some_and(|letter| letter.3.contains("skip then retry")),
        "the skip asked first is done: {dead:?}"
    );
    shutdown.cancel();
    running.await.unwrap().unwrap();
    once_each_and_in_order(&shop).await;
    kafka.nothing_left_uncommitted(&group, &topic).await;
}

/// A record for the holds topic: key, headers, payload.
type Scribble<'a> = (Option<Vec<u8>>, Vec<(&'a str, &'a [u8])>, Option<&'a [u8]>);

/// Writes a record with `key` (none: no key), `headers` and `payload` to `topic`'s partition 0.
async fn scribble(
    producer: &FutureProducer,
    topic: &str,
    key: Option<&[u8]>,
    headers: &[(&str, &[u8])],
    payload: Option<&[u8]>,
) {
    let mut owned = OwnedHeaders::new();
    for (name, value) in headers {
        owned = owned.insert(Header {
            key: name,
            value: Some(*value),
        });
    }
    let mut record = FutureRecord::<[u8], [u8]>::to(topic)
        .partition(0)
        .headers(owned);
    if let Some(key) = key {
        record = record.key(key);
    }
    if let Some(payload) = payload {
        record = record.payload(payload);
    }
    producer
        .send(record, Duration::from_secs(10))
        .await
        .map_err(|(error, _)| error)
        .expect("garbage written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_the_holds_topic_neither_stops_the_runner_nor_ends_or_hides_a_hold() {
    let kafka = Kafka::start();
    let topic = kafka.topic("garbage", 2).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    for (id, kind) in [
        ("p0-0", Kind::Ok),
        ("p0-1", Kind::Poison),
        ("p0-2", Kind::Ok),
    ] {
        kafka.produce_to(&topic, 0, id, kind).await;
    }
    let shutdown = Shutdown::new();
    let running = spawn(runner(&kafka, &group, &topic), &shop, 1, &shutdown);
    eventually(LIMIT, async || kafka.holds(&group).await.len() == 1).await;
    let real = kafka.holds(&group).await.remove(0);

    let producer: FutureProducer = kafka
        .client()
        .set("message.max.bytes", "2000000")
        .create()
        .unwrap();
    let holds_topic = kafka::holds_topic(&group);
    let (hold, command, reason) = (
        kafka::HOLD_HEADER,
        kafka::COMMAND_HEADER,
        kafka::REASON_HEADER,
    );
    let on = |partition: &str| format!("command:{topic}:{partition}");
    let huge = vec![b'x'; 900_000];
    let garbage: Vec<Scribble> = vec![
        (None, vec![], Some(b"no key")),
        (Some(vec![0xff, 0xfe, b':', 0x80]), vec![], Some(b"x")),
        (Some(b"held".to_vec()), vec![], Some(b"x")),
        (
            Some(b"command::".to_vec()),
            vec![(command, b"skip")],
            Some(b"x"),
        ),
        (
            Some(on("zero").into_bytes()),
            vec![(hold, b"h"), (command, b"skip")],
            Some(b"x"),
        ),
        (
            Some(on("-1").into_bytes()),
            vec![(hold, b"h"), (command, b"skip")],
            Some(b"x"),
        ),
        (
            Some(on("99999999999").into_bytes()),
            vec![(hold, b"h"), (command, b"retry")],
            None,
        ),
        (
            Some(on("999").into_bytes()),
            vec![(hold, b"h"), (command, b"skip")],
            Some(b"x"),
        ),
        // For the held partition: no hold named, a hold never announced, an unknown command, a
        // command that is not UTF-8, and a 900 KB reason for a hold never announced.
        (
            Some(on("0").into_bytes()),
            vec![(command, b"skip")],
            Some(b"x"),
        ),
        (
            Some(on("0").into_bytes()),
            vec![(hold, b"nobody"), (command, b"skip")],
            Some(b"x"),
        ),
        (
            Some(on("0").into_bytes()),
            vec![(hold, b"nobody"), (command, b"retry")],
            Some(b"x"),
        ),
        (
            Some(on("0").into_bytes()),
            vec![(hold, real.hold.as_bytes()), (command, b"explode")],
            Some(b"x"),
        ),
        (
            Some(on("0").into_bytes()),
            vec![(hold, real.hold.as_bytes()), (command, &[0xff, 0xfe])],
            Some(b"x"),
        ),
        (
            Some(on("0").into_bytes()),
            vec![(hold, b"nobody"), (command, b"skip"), (reason, &huge)],
            Some(b"x"),
        ),
        // Holds announced for the other partition with an offset that is no number, and none.
        (
            Some(format!("held:{topic}:1").into_bytes()),
            vec![(hold, b"h1"), (kafka::OFFSET_HEADER, b"ten")],
            Some(b"x"),
        ),
        (
            Some(format!("held:{topic}:1").into_bytes()),
            vec![(hold, b"h1")],
            Some(b"x"),
        ),
        (Some(format!("held:{topic}:1").into_bytes()), vec![], None),
        (
            Some(format!("nonsense:{topic}:0").into_bytes()),
            vec![],
            Some(b"x"),
        ),
    ];
    for (key, headers, payload) in &garbage {
        scribble(&producer, &holds_topic, key.as_deref(), headers, *payload).await;
    }
    // The other partition flows after the garbage: the runner read it and goes on.
    for i in 0..5 {
        kafka
            .produce_to(&topic, 1, &format!("p1-{i}"), Kind::Ok)
            .await;
    }
    eventually(LIMIT, async || shop.effects().await.len() == 6).await;
    assert!(!running.is_finished(), "the runner stopped");
    let listed = kafka.holds(&group).await;
    assert_eq!(listed, std::slice::from_ref(&real), "the hold changed");
    assert!(
        !shop.effects().await.contains_key("p0-2"),
        "passed the hold"
    );
    assert!(dead_letters(&kafka, &topic).await.is_empty());
    not_committed_past(&kafka, &group, &topic, 0, 1).await;

    // A reason too large to send is refused, and the hold stays; a 900 KB one is sent, and its dead
    // letter's reason is cut to what a header takes.
    let operator = HeldPartitions::new(kafka.client(), &group);
    let too_large = "y".repeat(2_000_000);
    let refused = operator.skip(&topic, 0, &too_large).await;
    assert!(refused.is_err(), "a 2 MB reason was sent");
    let large = "z".repeat(900_000);
    operator.skip(&topic, 0, &large).await.unwrap();
    eventually(LIMIT, async || {
        shop.effects().await.contains_key("p0-2") && kafka.holds(&group).await.is_empty()
    })
    .await;
    let dead = dead_letters(&kafka, &topic).await;
    assert_eq!(dead.len(), 1, "{:?}", dead.len());
    assert_eq!((dead[0].0, dead[0].1, dead[0].2.as_str()), (0, 1, "p0-1"));
    assert!(
        dead[0].3.starts_with("skipped by an operator: zzz") && dead[0].3.len() < 100_000,
        "{} bytes",
        dead[0].3.len()
    );
    shutdown.cancel();
    running.await.unwrap().unwrap();
    once_each_and_in_order(&shop).await;
    kafka.nothing_left_uncommitted(&group, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_hold_announcement_keeps_the_partition_held_and_it_is_announced_once_taken() {
    let kafka = Kafka::mock();
    let topic = kafka.topic("refused", 1).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    for (id, kind) in [
        ("p0-0", Kind::Ok),
        ("p0-1", Kind::Poison),
        ("p0-2", Kind::Ok),
    ] {
        kafka.produce_to(&topic, 0, id, kind).await;
    }
    // The hold's announcement, its first three times: nothing else produces meanwhile.
    kafka.refuse_produce(3);
    let shutdown = Shutdown::new();
    let runner = runner(&kafka, &group, &topic);
    let stats = runner.stats();
    let running = spawn(runner, &shop, 2, &shutdown);
    eventually(LIMIT, async || kafka.holds(&group).await.len() == 1).await;
    assert!(
        shop.attempts_of("p0-1").len() >= 4,
        "announced before three refusals: {:?}",
        shop.attempt_numbers("p0-1")
    );
    assert_eq!(
        shop.committed_in_order().await,
        ["p0-0"],
        "a record ran while its hold could not be announced"
    );
    not_committed_past(&kafka, &group, &topic, 0, 1).await;
    let hold = kafka.holds(&group).await.remove(0);
    assert_eq!((hold.offset, hold.message_id.as_deref()), (1, Some("p0-1")));
    HeldPartitions::new(kafka.client(), &group)
        .skip(&topic, 0, "announced late")
        .await
        .unwrap();
    eventually(LIMIT, async || {
        shop.effects().await.contains_key("p0-2") && kafka.holds(&group).await.is_empty()
    })
    .await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    assert_eq!(
        (stats().held, stats().dead_lettered),
        (1, 1),
        "{:?}",
        stats()
    );
    let dead = dead_letters(&kafka, &topic).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert!(dead[0].3.contains("announced late"), "{dead:?}");
    once_each_and_in_order(&shop).await;
    kafka.nothing_left_uncommitted(&group, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_broker_down_while_a_partition_is_held_and_back_the_hold_stays_until_its_skip() {
    let kafka = Kafka::mock();
    let topic = kafka.topic("down", 2).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    for (id, kind) in [
        ("p0-0", Kind::Ok),
        ("p0-1", Kind::Poison),
        ("p0-2", Kind::Ok),
    ] {
        kafka.produce_to(&topic, 0, id, kind).await;
    }
    kafka.produce_to(&topic, 1, "p1-0", Kind::Ok).await;
    let shutdown = Shutdown::new();
    let running = spawn(runner(&kafka, &group, &topic), &shop, 2, &shutdown);
    eventually(LIMIT, async || {
        kafka.holds(&group).await.len() == 1 && shop.effects().await.len() == 2
    })
    .await;
    kafka.all_down();
    tokio::time::sleep(Duration::from_secs(3)).await;
    kafka.all_up();
    for i in 1..5 {
        kafka
            .produce_to(&topic, 1, &format!("p1-{i}"), Kind::Ok)
            .await;
    }
    // librdkafka finds its brokers again, rejoins the group and fetches: tens of seconds against
    // the mock cluster (as in runner_kafka's outage test).
    eventually(Duration::from_secs(180), async || {
        shop.effects().await.contains_key("p1-4")
            && try_holds(&kafka, &group)
                .await
                .is_some_and(|held| held.len() == 1)
    })
    .await;
    assert!(
        !shop.effects().await.contains_key("p0-2"),
        "passed the hold"
    );
    assert!(!running.is_finished(), "the runner stopped");
    not_committed_past(&kafka, &group, &topic, 0, 1).await;
    // The hold listed now (the runner's, or its own again after it rejoined) is the one skipped.
    HeldPartitions::new(kafka.client(), &group)
        .skip(&topic, 0, "after the outage")
        .await
        .unwrap();
    eventually(LIMIT, async || {
        shop.effects().await.contains_key("p0-2") && kafka.holds(&group).await.is_empty()
    })
    .await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    let dead = dead_letters(&kafka, &topic).await;
    assert!(!dead.is_empty(), "not dead-lettered");
    assert!(
        dead.iter()
            .all(|letter| (letter.1, letter.2.as_str()) == (1, "p0-1")
                && letter.3.contains("after the outage")),
        "{dead:?}"
    );
    assert!(!shop.effects().await.contains_key("p0-1"));
    once_each_and_in_order(&shop).await;
    kafka.nothing_left_uncommitted(&group, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_partitions_held_at_once_are_all_listed_skipped_and_flow_in_order() {
    let kafka = Kafka::start();
    let topic = kafka.topic("sixteen", 16).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    // Each partition: one that succeeds, one that fails for good (a poison record on even
    // partitions, a handler that panics on odd ones), then three more.
    for partition in 0..16 {
        let bad = if partition % 2 == 0 {
            Kind::Poison
        } else {
            Kind::Panic
        };
        for (i, kind) in [Kind::Ok, bad, Kind::Ok, Kind::Ok, Kind::Ok]
            .into_iter()
            .enumerate()
        {
            let id = format!("p{partition:02}-{i}");
            kafka.produce_to(&topic, partition, &id, kind).await;
        }
    }
    let shutdown = Shutdown::new();
    let runner = runner(&kafka, &group, &topic);
    let stats = runner.stats();
    let running = spawn(runner, &shop, 2, &shutdown);
    eventually(LIMIT, async || kafka.holds(&group).await.len() == 16).await;
    let held = kafka.holds(&group).await;
    let at: Vec<(i32, i64)> = held
        .iter()
        .map(|hold| (hold.partition, hold.offset))
        .collect();
    assert_eq!(at, (0..16).map(|p| (p, 1)).collect::<Vec<_>>());
    for hold in &held {
        let expected = if hold.partition % 2 == 0 {
            "poison"
        } else {
            "the order book is corrupt"
        };
        assert!(hold.reason.contains(expected), "{hold:?}");
    }
    assert_eq!(
        shop.effects().await.len(),
        16,
        "only the records before the holds ran"
    );
    for partition in 0..16 {
        not_committed_past(&kafka, &group, &topic, partition, 1).await;
    }
    let operator = HeldPartitions::new(kafka.client(), &group);
    let skipped = futures::future::join_all(
        (0..16).map(|partition| operator.skip(&topic, partition, "mass skip")),
    )
    .await;
    assert!(skipped.iter().all(Result::is_ok), "{skipped:?}");
    eventually(LIMIT, async || {
        shop.effects().await.len() == 64 && kafka.holds(&group).await.is_empty()
    })
    .await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    assert_eq!(
        (stats().held, stats().dead_lettered),
        (16, 16),
        "{:?}",
        stats()
    );
    let mut dead = dead_letters(&kafka, &topic).await;
    dead.sort();
    assert_eq!(dead.len(), 16, "{dead:?}");
    for (partition, letter) in dead.iter().enumerate() {
        assert_eq!((letter.0, letter.1), (partition as i32, 1), "{dead:?}");
        assert!(letter.3.contains("mass skip"), "{letter:?}");
    }
    once_each_and_in_order(&shop).await;
    kafka.nothing_left_uncommitted(&group, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_batches_a_record_that_fails_holds_its_partition_and_nothing_after_it_takes_effect() {
    let kafka = Kafka::start();
    let topic = kafka.topic("batched", 4).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    // Partition 2's third record fails for good, and partition 3's fails its first five attempts;
    // the rest succeed.
    for i in 0..10 {
        for partition in 0..4 {
            let id = format!("p{partition}-{i}");
            let kind = match (partition, i) {
                (2, 2) => Kind::Poison,
                (3, 2) => Kind::Flaky(5),
                _ => Kind::Ok,
            };
            kafka.produce_to(&topic, partition, &id, kind).await;
        }
    }
    let shutdown = Shutdown::new();
    let running = spawn_batches(runner(&kafka, &group, &topic), &shop, 2, &shutdown);
    eventually(LIMIT, async || {
        kafka.holds(&group).await.len() == 2 && shop.effects().await.len() == 24
    })
    .await;
    let effects = shop.effects().await;
    for partition in 2..4 {
        for i in 2..10 {
            let id = format!("p{partition}-{i}");
            assert!(!effects.contains_key(&id), "{id} took effect past its hold");
        }
        not_committed_past(&kafka, &group, &topic, partition, 2).await;
    }
    let operator = HeldPartitions::new(kafka.client(), &group);
    operator.skip(&topic, 2, "batch poison").await.unwrap();
    // Partition 3's record: retried until it succeeds (its fourth attempt fails and holds again).
    while !shop.effects().await.contains_key("p3-2") {
        match operator.retry(&topic, 3).await {
            Ok(_) | Err(BrokerError::NotHeld { .. }) => {}
            Err(error) => panic!("{error}"),
        }
        eventually(LIMIT, async || {
            shop.effects().await.contains_key("p3-2") || kafka.holds(&group).await.len() == 1
        })
        .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eventually(LIMIT, async || {
        shop.effects().await.len() == 39 && kafka.holds(&group).await.is_empty()
    })
    .await;
    shutdown.cancel();
    let stats = running.await.unwrap().unwrap();
    assert_eq!((stats.processed, stats.dead_lettered), (39, 1), "{stats:?}");
    let dead = dead_letters(&kafka, &topic).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!((dead[0].0, dead[0].1), (2, 2));
    assert!(dead[0].3.contains("batch poison"), "{dead:?}");
    assert_eq!(shop.attempt_numbers("p3-2"), [1, 2, 3, 4, 5, 6]);
    once_each_and_in_order(&shop).await;
    kafka.nothing_left_uncommitted(&group, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_held_right_after_a_skip_is_listed_and_retried_as_its_own_hold() {
    let kafka = Kafka::start();
    let topic = kafka.topic("twice", 8).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    // Each partition: two poison records in a row, then one that succeeds. The second fails as
    // soon as the first's skip lets the partition go on, while the skip is being finished.
    for partition in 0..8 {
        for (i, kind) in [Kind::Poison, Kind::Poison, Kind::Ok]
            .into_iter()
            .enumerate()
        {
            let id = format!("p{partition}-{i}");
            kafka.produce_to(&topic, partition, &id, kind).await;
        }
    }
    let shutdown = Shutdown::new();
    let running = spawn(runner(&kafka, &group, &topic), &shop, 2, &shutdown);
    let held_at = async |offset: i64| {
        let held = kafka.holds(&group).await;
        held.len() == 8 && held.iter().all(|hold| hold.offset == offset)
    };
    eventually(LIMIT, async || held_at(0).await).await;
    let operator = HeldPartitions::new(kafka.client(), &group);
    let skipped = futures::future::join_all(
        (0..8).map(|partition| operator.skip(&topic, partition, "first")),
    )
    .await;
    assert!(skipped.iter().all(Result::is_ok), "{skipped:?}");
    // Each second record is held and listed: the first's end did not hide its hold.
    eventually(LIMIT, async || held_at(1).await).await;
    // And its runner still knows it: a retry runs it again (and it is held again).
    let retried =
        futures::future::join_all((0..8).map(|partition| operator.retry(&topic, partition))).await;
    assert!(retried.iter().all(Result::is_ok), "{retried:?}");
    eventually(LIMIT, async || {
        (0..8).all(|p| shop.attempts_of(&format!("p{p}-1")).len() == 2) && held_at(1).await
    })
    .await;
    let skipped = futures::future::join_all(
        (0..8).map(|partition| operator.skip(&topic, partition, "second")),
    )
    .await;
    assert!(skipped.iter().all(Result::is_ok), "{skipped:?}");
    eventually(LIMIT, async || {
        shop.effects().await.len() == 8 && kafka.holds(&group).await.is_empty()
    })
    .await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    let mut dead = dead_letters(&kafka, &topic).await;
    dead.sort();
    assert_eq!(dead.len(), 16, "{dead:?}");
    for letter in &dead {
        let expected = if letter.1 == 0 { "first" } else { "second" };
        assert!(letter.3.contains(expected), "{letter:?}");
    }
    once_each_and_in_order(&shop).await;
    kafka.nothing_left_uncommitted(&group, &topic).await;
}
