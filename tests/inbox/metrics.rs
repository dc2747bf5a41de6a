//! The inbox reports through the `metrics` facade, with the names and labels the README documents:
//! a recorder installed by the program (here `metrics-util`'s debugging recorder) sees the counters
//! move and the claim wait time, including a claim that waited on an in-flight twin, and an outbox
//! relay counts what it published, retried and parked, its backlog and each message's delay.
#![cfg(feature = "sqlite")]

#[path = "../support/mod.rs"]
mod support;

use std::time::{Duration, SystemTime};

use idempotent::message_key;
use metrics_util::MetricKind;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use support::sqlite::SqliteHarness;
use support::{Behaviour, Consumer, Delivery, Harness, Outgoing};

/// A broker that confirms every outgoing message but those for `nowhere`, which it refuses.
struct Broker;

impl idempotent::outbox::Publisher for Broker {
    async fn publish(
        &self,
        publication: &idempotent::outbox::Publication,
    ) -> Result<(), idempotent::outbox::PublishError> {
        if publication.destination.routing_key == "nowhere" {
            return Err(idempotent::outbox::PublishError::rejected("unroutable"));
        }
        Ok(())
    }
}

/// One metric's values from a snapshot: `(kind, name, labels, value)`.
type Entry = (MetricKind, String, Vec<(String, String)>, DebugValue);

fn counter(entries: &[Entry], name: &str, labels: &[(&str, &str)]) -> u64 {
    entries
        .iter()
        .filter(|(kind, n, l, _)| {
            *kind == MetricKind::Counter
                && n == name
                && labels
                    .iter()
                    .all(|(k, v)| l.iter().any(|(lk, lv)| lk == k && lv == v))
        })
        .map(|(_, _, _, value)| match value {
            DebugValue::Counter(n) => *n,
            other => panic!("{other:?}"),
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_and_the_claim_wait_histogram_reach_the_installed_recorder() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder
        .install()
        .expect("the only recorder of this test binary");
    idempotent::metrics::describe();

    let h = SqliteHarness::new().await;
    let paid = Delivery::new("paid");
    assert!(
        h.deliver(Consumer::Orders, &paid)
            .await
            .unwrap()
            .is_processed()
    );
    assert!(
        h.deliver(Consumer::Orders, &paid)
            .await
            .unwrap()
            .is_duplicate()
    );
    let failing = Delivery::new("fails").behaving(Behaviour::Fail);
    h.deliver(Consumer::Orders, &failing).await.unwrap_err();
    assert!(
        h.deliver_payment(&Delivery::new("p1").with_id("pay"))
            .await
            .unwrap()
            .is_processed()
    );
    h.deliver_payment(&Delivery::new("p2").with_id("pay"))
        .await
        .unwrap_err();

    // A claim that waits for an in-flight twin's commit.
    let held = h.inbox().claim("orders", "twin").await.unwrap().unwrap();
    let twin = Delivery::new("twin");
    let (outcome, ()) = tokio::join!(h.deliver(Consumer::Orders, &twin), async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        held.commit().await.unwrap();
    });
    assert!(outcome.unwrap().is_duplicate());

    // A message older than the purge horizon; a forgotten one; a call in progress; a purge.
    let old = Delivery::new("old").sent(SystemTime::now() - Duration::from_secs(20 * 86_400));
    assert!(
        h.deliver(Consumer::Events, &old)
            .await
            .unwrap()
            .is_processed()
    );
    h.backdate("events", Duration::from_secs(15 * 86_400)).await;
    assert_eq!(h.inbox().purge_expired(10).await.unwrap().deleted, 1);
    h.deliver(Consumer::Events, &old).await.unwrap_err();
    assert!(h.inbox().forget("orders", "paid", "a test").await.unwrap());
    let key = message_key("call").unwrap();
    let lease = Duration::from_secs(30);
    h.inbox()
        .begin_call::<u32>("orders", &key, "charge", lease)
        .await
        .unwrap();
    h.inbox()
        .begin_call::<u32>("orders", &key, "charge", lease)
        .await
        .unwrap_err();

    // Outgoing messages: two confirmed, one refused twice and parked.
    for (label, destination) in [
        ("n1", "notifications"),
        ("n2", "notifications"),
        ("n3", "nowhere"),
    ] {
        let outgoing = Outgoing {
            destination: destination.into(),
            ..Outgoing::default()
        };
        let msg = Delivery::new(label).sending(outgoing);
        assert!(h.deliver_notifier(&msg).await.unwrap().is_processed());
    }
    let options = idempotent::outbox::RelayOptions::default()
        .attempts(2, Duration::from_millis(10))
        .poll_interval(Duration::from_millis(5), Duration::from_millis(20));
    let relay = h.inbox().spawn_relay(Broker, options);
    let start = std::time::Instant::now();
    while h.inbox().outbox_stats().await.unwrap().parked == 0 {
        assert!(start.elapsed() < Duration::from_secs(30));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    relay.shutdown().await;

    let snapshot = snapshotter.snapshot().into_vec();
    let described = snapshot
        .iter()
        .find(|(key, ..)| key.key().name() == "idempotent_claim_wait_seconds")
        .map(|(_, unit, description, _)| (*unit, description.is_some()));
    assert_eq!(described, Some((Some(metrics::Unit::Seconds), true)));
    let entries: Vec<Entry> = snapshot
        .into_iter()
        .map(|(key, _, _, value)| {
            let labels = key
                .key()
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            (key.kind(), key.key().name().to_owned(), labels, value)
        })
        .collect();
    let messages = |consumer, outcome| {
        counter(
            &entries,
            "idempotent_messages_total",
            &[("consumer", consumer), ("outcome", outcome)],
        )
    };
    assert_eq!(
        messages("orders", "processed"),
        2,
        "`paid` and the held `twin`"
    );
    assert_eq!(messages("orders", "duplicate"), 2);
    assert_eq!(messages("orders", "rolled_back"), 1);
    assert_eq!(messages("payments", "processed"), 1);
    assert_eq!(messages("payments", "fingerprint_mismatch"), 1);
    assert_eq!(messages("events", "processed"), 1);
    assert_eq!(messages("events", "older_than_horizon"), 1);
    assert_eq!(
        counter(
            &entries,
            "idempotent_forgotten_total",
            &[("consumer", "orders")]
        ),
        1
    );
    assert_eq!(
        counter(
            &entries,
            "idempotent_calls_total",
            &[("consumer", "orders"), ("outcome", "in_progress")]
        ),
        1
    );
    assert_eq!(
        counter(
            &entries,
            "idempotent_purged_rows_total",
            &[("table", "idempotent_inbox"), ("kind", "inbox")]
        ),
        1
    );

    let outbox = |name, labels: &[(&str, &str)]| {
        let mut labels = labels.to_vec();
        labels.push(("table", "idempotent_inbox"));
        counter(&entries, name, &labels)
    };
    assert_eq!(outbox("idempotent_outbox_published_total", &[]), 2);
    assert_eq!(
        outbox("idempotent_outbox_retried_total", &[("reason", "rejected")]),
        1
    );
    assert_eq!(outbox("idempotent_outbox_parked_total", &[]), 1);
    let delays = entries
        .iter()
        .filter(|(kind, name, ..)| {
            *kind == MetricKind::Histogram && name == "idempotent_outbox_delay_seconds"
        })
        .map(|(.., value)| match value {
            DebugValue::Histogram(values) => values.len(),
            other => panic!("{other:?}"),
        })
        .sum::<usize>();
    assert_eq!(delays, 2);
    let backlog = entries
        .iter()
        .find(|(kind, name, ..)| *kind == MetricKind::Gauge && name == "idempotent_outbox_backlog");
    assert!(
        matches!(backlog, Some((.., DebugValue::Gauge(rows))) if rows.into_inner() == 3.0),
        "the relay's first look counts the three unsent messages: {backlog:?}"
    );

    let waits: Vec<f64> = entries
        .iter()
        .filter(|(kind, name, labels, _)| {
            *kind == MetricKind::Histogram
                && name == "idempotent_claim_wait_seconds"
                && labels.contains(&("consumer".to_owned(), "orders".to_owned()))
                && labels.contains(&("outcome".to_owned(), "duplicate".to_owned()))
        })
        .flat_map(|(_, _, _, value)| match value {
            DebugValue::Histogram(values) => {
                values.iter().map(|v| v.into_inner()).collect::<Vec<f64>>()
            }
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(waits.len(), 2, "{waits:?}");
    assert!(
        waits.iter().any(|w| *w >= 0.25),
        "the twin's wait is not in the histogram: {waits:?}"
    );
}
