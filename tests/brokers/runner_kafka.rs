//! The Kafka runner and the outbox's Kafka publisher, against the Kafka of
//! `tests/brokers/support/kafka.rs` (a real server at `IDEMPOTENT_KAFKA_URL`, or librdkafka's mock
//! cluster): every record's effect once, per-partition order of those that succeed, retries on
//! retry topics that hold back nothing else, the poison and bad input (no key, a malformed body, a
//! 1 MB body) dead-lettered with their reason, nothing left uncommitted at the end; graceful
//! shutdown and a second runner taking over; a second runner joining and leaving mid-stream (a
//! rebalance); every broker down mid-stream, and past the group's session timeout; a dead letter the broker refuses three times (tried
//! again after its back-off, its partition held, the other flowing); a dead-letter topic that
//! cannot be made.
#![cfg(all(feature = "kafka", feature = "sqlite"))]

mod support;

use std::collections::HashMap;
use std::time::Duration;

use idempotent::broker::kafka::{self, Runner};
use idempotent::broker::{BrokerError, RetryPolicy, Shutdown};
use idempotent::outbox::{Destination, OutgoingMessage, Publication, PublishError, Publisher};
use support::kafka::{Kafka, Message as _, header, spawn, spawn_batches};
use support::{Kind, Shop, eventually};

/// A runner on `topic` in a group of its own, with a short retry policy.
fn runner(kafka: &Kafka, group: &str, topic: &str) -> Runner {
    Runner::new(kafka.client(), group, &[topic], format!("{topic}.dead"))
        .retry(RetryPolicy::new(3, Duration::from_millis(300)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_record_once_in_partition_order_and_bad_input_dead_lettered_with_its_reason() {
    let kafka = Kafka::start();
    let topic = kafka.topic("orders", 4).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    // 20 keys, 10 records each: a key's records go to one partition, in this order.
    let mut produced: HashMap<String, Vec<String>> = HashMap::new();
    for i in 0..200 {
        let key = format!("customer-{}", i % 20);
        let id = format!("order-{i}");
        let kind = match i {
            50 => Kind::Flaky(1),
            120 => Kind::Poison,
            _ => Kind::Ok,
        };
        kafka.produce(&topic, &key, Some(&id), kind).await;
        if i % 10 == 3 {
            // Produced twice: a new offset, the same message id.
            kafka.produce(&topic, &key, Some(&id), kind).await;
        }
        if kind == Kind::Ok {
            produced.entry(key).or_default().push(id);
        }
    }
    kafka.produce(&topic, "customer-0", None, Kind::Ok).await;
    kafka
        .produce_raw(&topic, "customer-1", Some("garbled"), b"{not json")
        .await;
    let huge = vec![b' '; 900 << 10];
    kafka
        .produce_raw(&topic, "customer-2", Some("huge"), &huge)
        .await;

    let shutdown = Shutdown::new();
    let running = spawn(runner(&kafka, &group, &topic), &shop, 4, &shutdown);
    let dead = format!("{topic}.dead");
    eventually(Duration::from_secs(60), async || {
        shop.effects().await.len() == 199 && kafka.records(&dead).await.len() == 4
    })
    .await;
    shutdown.cancel();
    let stats = running.await.unwrap().unwrap();

    let effects = shop.effects().await;
    assert!(
        effects.values().all(|count| *count == 1),
        "an effect twice: {effects:?}"
    );
    assert_eq!(
        effects.get("order-50"),
        Some(&1),
        "the flaky order, after its retry"
    );
    // The poison's body ran and rolled back.
    assert_eq!(effects.get("order-120"), None);
    assert_eq!(
        stats.duplicates, 20,
        "each record produced twice is a duplicate once"
    );
    assert_eq!((stats.retried, stats.dead_lettered), (1, 4));

    // The records of a key that succeeded at once took effect in their order.
    let order = shop.committed_in_order().await;
    for (key, ids) in &produced {
        let seen: Vec<&String> = order.iter().filter(|id| ids.contains(id)).collect();
        let expected: Vec<&String> = ids.iter().collect();
        assert_eq!(seen, expected, "the records of {key} out of order");
    }

    let dead_letters = kafka.records(&dead).await;
    let reasons: HashMap<String, String> = dead_letters
        .iter()
        .map(|record| {
            let id = header(record, "message-id").unwrap_or_else(|| "(none)".into());
            (id, header(record, kafka::REASON_HEADER).unwrap())
        })
        .collect();
    assert!(reasons["order-120"].contains("poison"), "{reasons:?}");
    assert!(
        reasons["(none)"].contains("no message-id header"),
        "{reasons:?}"
    );
    assert!(reasons["garbled"].contains("not an order"), "{reasons:?}");
    for record in &dead_letters {
        assert_eq!(
            header(record, kafka::TOPIC_HEADER).as_deref(),
            Some(topic.as_str())
        );
        assert!(header(record, kafka::OFFSET_HEADER).is_some());
    }
    let huge_dead = dead_letters
        .iter()
        .find(|r| header(r, "message-id").as_deref() == Some("huge"))
        .expect("the 900 KB body, not an order either, dead-lettered whole");
    assert_eq!(huge_dead.payload().map(<[u8]>::len), Some(900 << 10));

    kafka.nothing_left_uncommitted(&group, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_waits_its_delay_on_its_retry_topic_and_holds_back_nothing() {
    let kafka = Kafka::start();
    let topic = kafka.topic("flaky", 1).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    kafka
        .produce(&topic, "k", Some("flaky"), Kind::Flaky(2))
        .await;
    for i in 0..5 {
        kafka
            .produce(&topic, "k", Some(&format!("after-{i}")), Kind::Ok)
            .await;
    }
    let shutdown = Shutdown::new();
    let running = spawn(runner(&kafka, &group, &topic), &shop, 1, &shutdown);
    eventually(Duration::from_secs(30), async || {
        shop.effects().await.contains_key("flaky")
    })
    .await;
    shutdown.cancel();
    let stats = running.await.unwrap().unwrap();
    shop.assert_retried_after("flaky", &[300, 600]);
    // The partition went on while the retry waited.
    let order = shop.committed_in_order().await;
    assert_eq!(order.last().map(String::as_str), Some("flaky"), "{order:?}");
    assert_eq!((stats.retried, stats.processed), (2, 6));
    kafka.nothing_left_uncommitted(&group, &topic).await;
    kafka
        .nothing_left_uncommitted(&group, &format!("{group}.retry.300ms"))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_mid_stream_commits_what_is_done_and_the_next_runner_goes_on() {
    let kafka = Kafka::start();
    let topic = kafka.topic("slow", 4).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    for i in 0..40 {
        kafka
            .produce(
                &topic,
                &format!("k{}", i % 8),
                Some(&format!("slow-{i}")),
                Kind::Slow(20),
            )
            .await;
    }
    let shutdown = Shutdown::new();
    let running = spawn(runner(&kafka, &group, &topic), &shop, 2, &shutdown);
    eventually(Duration::from_secs(30), async || {
        shop.effects().await.len() >= 10
    })
    .await;
    shutdown.cancel();
    let first = running.await.unwrap().unwrap();
    assert!(first.processed >= 10);

    let shutdown = Shutdown::new();
    let running = spawn(runner(&kafka, &group, &topic), &shop, 2, &shutdown);
    eventually(Duration::from_secs(30), async || {
        shop.effects().await.len() == 40
    })
    .await;
    shutdown.cancel();
    let second = running.await.unwrap().unwrap();
    let effects = shop.effects().await;
    assert!(effects.values().all(|count| *count == 1), "{effects:?}");
    assert_eq!(
        first.processed + second.processed,
        40,
        "what the first committed, the second did not run again"
    );
    kafka.nothing_left_uncommitted(&group, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_runner_joining_and_leaving_mid_stream_loses_nothing_and_doubles_nothing() {
    let kafka = Kafka::start();
    let topic = kafka.topic("rebalance", 6).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    for i in 0..300 {
        kafka
            .produce(
                &topic,
                &format!("k{}", i % 30),
                Some(&format!("r-{i}")),
                Kind::Slow(5),
            )
            .await;
    }
    let first_stop = Shutdown::new();
    let first = spawn(runner(&kafka, &group, &topic), &shop, 2, &first_stop);
    eventually(Duration::from_secs(30), async || {
        shop.effects().await.len() >= 50
    })
    .await;
    let second_stop = Shutdown::new();
    let second = spawn(runner(&kafka, &group, &topic), &shop, 2, &second_stop);
    eventually(Duration::from_secs(60), async || {
        shop.effects().await.len() >= 150
    })
    .await;
    second_stop.cancel();
    let _ = second.await.unwrap().unwrap();
    eventually(Duration::from_secs(60), async || {
        shop.effects().await.len() == 300
    })
    .await;
    first_stop.cancel();
    let _ = first.await.unwrap().unwrap();
    let effects = shop.effects().await;
    assert_eq!(effects.len(), 300);
    assert!(effects.values().all(|count| *count == 1), "{effects:?}");
    kafka.nothing_left_uncommitted(&group, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_broker_down_mid_stream_loses_nothing_and_the_runner_comes_back() {
    let kafka = Kafka::mock();
    let topic = kafka.topic("outage", 3).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    for i in 0..30 {
        kafka
            .produce(
                &topic,
                &format!("k{}", i % 6),
                Some(&format!("before-{i}")),
                Kind::Slow(10),
            )
            .await;
    }
    let shutdown = Shutdown::new();
    let runner = runner(&kafka, &group, &topic);
    let stats = runner.stats();
    let running = spawn(runner, &shop, 2, &shutdown);
    eventually(Duration::from_secs(30), async || {
        shop.effects().await.len() >= 10
    })
    .await;
    kafka.all_down();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !running.is_finished(),
        "the runner ended while its brokers were away"
    );
    kafka.all_up();
    for i in 0..30 {
        kafka
            .produce(
                &topic,
                &format!("k{}", i % 6),
                Some(&format!("after-{i}")),
                Kind::Ok,
            )
            .await;
    }
    // librdkafka finds its brokers again, rejoins the group and fetches: tens of seconds against
    // the mock cluster.
    eventually(Duration::from_secs(180), async || {
        shop.effects().await.len() == 60
    })
    .await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    let effects = shop.effects().await;
    assert!(effects.values().all(|count| *count == 1), "{effects:?}");
    assert!(
        stats().reconnects >= 1,
        "the outage was not noticed: {:?}",
        stats()
    );
    kafka.nothing_left_uncommitted(&group, &topic).await;
}

/// Every broker away for longer than the group's session timeout (6 s here): the group forgets
/// the runner, which must join it again and go on from the committed offsets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_broker_down_past_the_session_timeout_and_the_runner_joins_its_group_again() {
    let kafka = Kafka::mock();
    let topic = kafka.topic("long-outage", 2).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    for i in 0..10 {
        kafka
            .produce_to(&topic, i % 2, &format!("before-{i}"), Kind::Ok)
            .await;
    }
    let shutdown = Shutdown::new();
    let runner = runner(&kafka, &group, &topic);
    let running = spawn(runner, &shop, 2, &shutdown);
    eventually(Duration::from_secs(60), async || {
        shop.effects().await.len() == 10
    })
    .await;
    kafka.all_down();
    tokio::time::sleep(Duration::from_secs(8)).await;
    kafka.all_up();
    for i in 0..10 {
        kafka
            .produce_to(&topic, i % 2, &format!("after-{i}"), Kind::Ok)
            .await;
    }
    eventually(Duration::from_secs(180), async || {
        shop.effects().await.len() == 20
    })
    .await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    let effects = shop.effects().await;
    assert!(effects.values().all(|count| *count == 1), "{effects:?}");
    kafka.nothing_left_uncommitted(&group, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_the_broker_refuses_is_tried_again_and_holds_back_only_its_partition() {
    let kafka = Kafka::mock();
    let topic = kafka.topic("refused", 2).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    kafka.produce_to(&topic, 0, "poison", Kind::Poison).await;
    for i in 0..5 {
        kafka
            .produce_to(&topic, 0, &format!("behind-{i}"), Kind::Ok)
            .await;
        kafka
            .produce_to(&topic, 1, &format!("free-{i}"), Kind::Ok)
            .await;
    }
    // The runner's dead letter, its first three times: nothing else produces meanwhile.
    kafka.refuse_produce(3);
    let shutdown = Shutdown::new();
    let runner = runner(&kafka, &group, &topic);
    let stats = runner.stats();
    let running = spawn(runner, &shop, 2, &shutdown);
    // The other partition flows while the poison's dead letter is refused and waits its back-off.
    eventually(Duration::from_secs(30), async || {
        (0..5).all(|i| shop.attempts_of(&format!("free-{i}")).len() == 1)
    })
    .await;
    let dead = format!("{topic}.dead");
    eventually(Duration::from_secs(60), async || {
        kafka.records(&dead).await.len() == 1 && shop.effects().await.contains_key("behind-4")
    })
    .await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    assert_eq!(stats().released, 3, "{:?}", stats());
    assert_eq!(stats().dead_lettered, 1);
    let effects = shop.effects().await;
    assert!(effects.values().all(|count| *count == 1), "{effects:?}");
    assert!(!effects.contains_key("poison"));
    // Its partition waited for it: the records behind the poison ran after its dead letter.
    let order = shop.committed_in_order().await;
    let behind: Vec<&String> = order
        .iter()
        .filter(|id| id.starts_with("behind-"))
        .collect();
    assert_eq!(
        behind,
        ["behind-0", "behind-1", "behind-2", "behind-3", "behind-4"]
    );
    let poison_attempts = shop.attempts_of("poison");
    let first_behind = shop.attempts_of("behind-0");
    assert_eq!(
        poison_attempts.len(),
        4,
        "the handler ran again with each try of its dead letter"
    );
    assert!(
        first_behind[0].at > poison_attempts[3].at,
        "a record passed the poison"
    );
    kafka.nothing_left_uncommitted(&group, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_topic_that_cannot_be_made_stops_the_runner_at_start() {
    // tansu takes any topic name: the mock cluster refuses this one as a broker's ACLs would.
    let kafka = Kafka::mock();
    let topic = kafka.topic("nodlq", 1).await;
    let shop = Shop::new().await;
    kafka
        .produce(&topic, "k", Some("untouched"), Kind::Ok)
        .await;
    // A name Kafka refuses, and the mock cluster is told to refuse.
    let dead = "no such topic!";
    kafka.refuse_topic(dead);
    let runner = Runner::new(kafka.client(), format!("{topic}-ledger"), &[&topic], dead);
    let ended = tokio::time::timeout(
        Duration::from_secs(60),
        spawn(runner, &shop, 1, &Shutdown::new()),
    )
    .await
    .expect("the runner stops at start")
    .unwrap();
    assert!(
        matches!(&ended, Err(BrokerError::DeadLetterTarget { target, .. }) if target == dead),
        "{ended:?}"
    );
    assert!(shop.effects().await.is_empty(), "nothing is consumed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_settle_each_record_by_its_own_outcome() {
    let kafka = Kafka::start();
    let topic = kafka.topic("batches", 2).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    for i in 0..40 {
        let kind = if i == 7 { Kind::Poison } else { Kind::Ok };
        kafka
            .produce(
                &topic,
                &format!("k{}", i % 4),
                Some(&format!("b-{i}")),
                kind,
            )
            .await;
    }
    let shutdown = Shutdown::new();
    let running = spawn_batches(runner(&kafka, &group, &topic), &shop, 1, &shutdown);
    let dead = format!("{topic}.dead");
    eventually(Duration::from_secs(30), async || {
        shop.effects().await.len() == 39 && kafka.records(&dead).await.len() == 1
    })
    .await;
    shutdown.cancel();
    let stats = running.await.unwrap().unwrap();
    assert_eq!((stats.processed, stats.dead_lettered), (39, 1));
    assert!(shop.effects().await.values().all(|count| *count == 1));
    kafka.nothing_left_uncommitted(&group, &topic).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_of_several_workers_keep_each_partitions_order() {
    let kafka = Kafka::start();
    let topic = kafka.topic("batches", 4).await;
    let group = format!("{topic}-ledger");
    let shop = Shop::new().await;
    // 8 keys over 4 partitions, 30 records each; one in ten slow, so that batches overlap.
    let mut keys: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for i in 0..240 {
        let (key, id) = (format!("k{}", i % 8), format!("b-{i}"));
        let kind = if i % 10 == 3 {
            Kind::Slow(15)
        } else {
            Kind::Ok
        };
        kafka.produce(&topic, &key, Some(&id), kind).await;
        keys.entry(key).or_default().push(id);
    }
    let shutdown = Shutdown::new();
    let running = spawn_batches(runner(&kafka, &group, &topic), &shop, 4, &shutdown);
    eventually(Duration::from_secs(60), async || {
        shop.effects().await.len() == 240
    })
    .await;
    shutdown.cancel();
    let stats = running.await.unwrap().unwrap();
    assert_eq!(stats.processed, 240);
    assert!(shop.effects().await.values().all(|count| *count == 1));
    let order = shop.committed_in_order().await;
    for (key, ids) in &keys {
        let seen: Vec<&String> = order.iter().filter(|id| ids.contains(id)).collect();
        let expected: Vec<&String> = ids.iter().collect();
        assert_eq!(seen, expected, "the records of {key} out of order");
    }
    kafka.nothing_left_uncommitted(&group, &topic).await;
}

fn publication(id: &str, topic: &str, key: Option<&str>) -> Publication {
    let mut message = OutgoingMessage::new(Destination::topic(topic), id.as_bytes().to_vec())
        .with_header("trace", "t-1");
    if let Some(key) = key {
        message = message.with_ordering_key(key);
    }
    Publication::new(id, &message)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_publisher_keys_by_ordering_key_and_carries_the_message_id() {
    let kafka = Kafka::start();
    let topic = kafka.topic("outbox", 4).await;
    let publisher = kafka::OutboxPublisher::new(&kafka.client(), Duration::from_secs(10)).unwrap();
    for i in 0..20 {
        let id = format!("m-{i}");
        publisher
            .publish(&publication(&id, &topic, Some(&format!("key-{}", i % 3))))
            .await
            .unwrap();
    }
    let records = kafka.records(&topic).await;
    assert_eq!(records.len(), 20);
    let mut partition_of_key: HashMap<String, i32> = HashMap::new();
    let mut ids_of_key: HashMap<String, Vec<u32>> = HashMap::new();
    for record in &records {
        let key = String::from_utf8(record.key().unwrap().to_vec()).unwrap();
        let id = header(record, kafka::MESSAGE_ID_HEADER).unwrap();
        assert_eq!(header(record, "trace").as_deref(), Some("t-1"));
        assert_eq!(record.payload(), Some(id.as_bytes()));
        let partition = *partition_of_key
            .entry(key.clone())
            .or_insert(record.partition());
        assert_eq!(partition, record.partition(), "one key, one partition");
        ids_of_key
            .entry(key)
            .or_default()
            .push(id.trim_start_matches("m-").parse().unwrap());
    }
    for ids in ids_of_key.values() {
        assert!(
            ids.is_sorted(),
            "a key's records in the order published: {ids:?}"
        );
    }
    let refused = publisher
        .publish(&Publication::new(
            "x",
            &OutgoingMessage::new(Destination::exchange("amq.topic", &topic), b"x".to_vec()),
        ))
        .await;
    assert!(
        matches!(refused, Err(PublishError::Rejected { .. })),
        "{refused:?}"
    );
}
