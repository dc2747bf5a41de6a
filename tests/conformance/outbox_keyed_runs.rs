//! A relay batch takes several consecutive messages of an ordering key and publishes them one
//! after another, on every backend: a message that fails stops its key for the batch (the key's
//! later messages taken with it are not published, and go out after it once it is through), and
//! relays racing over many keys with several messages each keep every key's order and publish
//! each message once. The broker is the recording [`Recorder`] of `outbox.rs`, which also fails a
//! test that has two messages of one key in flight at once.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idempotent::outbox::{Destination, Outbox, OutgoingMessage, RelayOptions};
use idempotent::{Backend, Inbox};

use super::outbox::{Recorder, until_drained};
use crate::support::Harness;

/// Writes the messages `1..=count` of each of `keys`, message `n` of every key in one transaction
/// (so each key's numbers follow `n`), with the payload `<key>:<n>`.
async fn write<D: Backend>(inbox: &Inbox<D>, keys: &[String], count: u32) {
    for n in 1..=count {
        let mut outbox = Outbox::new("checkout", format!("round-{n}").as_str()).unwrap();
        for key in keys {
            outbox.send(
                OutgoingMessage::new(Destination::queue("orders"), format!("{key}:{n}"))
                    .with_ordering_key(key.as_str()),
            );
        }
        let mut tx = inbox.pool().begin().await.unwrap();
        inbox.enqueue(&mut tx, outbox).await.unwrap();
        tx.commit().await.unwrap();
    }
}

/// Per key, the numbers the broker confirmed, in the order it confirmed them.
fn published_per_key(recorder: &Recorder) -> HashMap<String, Vec<u32>> {
    let mut per_key: HashMap<String, Vec<u32>> = HashMap::new();
    for publication in recorder.published.lock().unwrap().iter() {
        let payload = String::from_utf8(publication.payload.clone()).unwrap();
        let (key, n) = payload.rsplit_once(':').unwrap();
        assert_eq!(publication.ordering_key.as_deref(), Some(key));
        per_key
            .entry(key.to_owned())
            .or_default()
            .push(n.parse().unwrap());
    }
    per_key
}

fn assert_no_key_in_flight_twice(recorder: &Recorder) {
    let overlaps = recorder.overlaps.lock().unwrap();
    assert!(overlaps.is_empty(), "in flight twice at once: {overlaps:?}");
}

/// Keys `a` and `b`, ten messages each, taken in one batch; the broker refuses `a:3` while it is
/// closed. The batch publishes `a:1`, `a:2` and all of `b`, stops `a` at its third message and
/// holds its fourth to tenth back untried; once the broker takes `a:3`, the rest of `a` follows
/// it, in order, each once.
pub async fn a_refused_message_holds_back_the_rest_of_its_keys_batch(h: impl Harness) {
    let keys = ["a".to_owned(), "b".to_owned()];
    write(h.inbox(), &keys, 10).await;
    let closed = Arc::new(AtomicBool::new(true));
    let recorder = {
        let closed = closed.clone();
        Recorder::refusing(Duration::ZERO, move |p| {
            closed.load(Ordering::SeqCst) && p.payload == b"a:3"
        })
    };
    let options = RelayOptions::default()
        .batch_size(100)
        .attempts(10, Duration::from_millis(20));
    let report = h.inbox().relay_once(&recorder, &options).await.unwrap();
    assert_eq!(report.taken, 20, "{report:?}");
    assert_eq!(
        (report.published, report.rejected, report.held_back),
        (12, 1, 7),
        "{report:?}"
    );
    let per_key = published_per_key(&recorder);
    assert_eq!(per_key["a"], [1, 2], "a's later messages overtook a:3");
    assert_eq!(per_key["b"], (1..=10).collect::<Vec<_>>());
    let stats = h.inbox().outbox_stats().await.unwrap();
    assert_eq!((stats.pending, stats.sent), (8, 12), "{stats:?}");

    closed.store(false, Ordering::SeqCst);
    let relay = h.inbox().spawn_relay(
        recorder.clone(),
        options.poll_interval(Duration::from_millis(5), Duration::from_millis(20)),
    );
    until_drained(&h).await;
    relay.shutdown().await;
    assert_no_key_in_flight_twice(&recorder);
    let per_key = published_per_key(&recorder);
    assert_eq!(per_key["a"], (1..=10).collect::<Vec<_>>());
    assert_eq!(per_key["b"], (1..=10).collect::<Vec<_>>());
    assert_eq!(recorder.refused.load(Ordering::SeqCst), 1);
}

/// 24 keys of 12 messages each, drained by two relays of three workers each (the second on a pool
/// of its own), in batches of 16 (several messages of a key per batch), through a broker that
/// refuses the first attempt of every key's 3rd, 7th and 11th message: every key's messages are
/// confirmed in their order, each exactly once, never two of a key at once.
pub async fn relays_racing_over_many_keys_keep_each_keys_order_and_publish_once(h: impl Harness) {
    const KEYS: usize = 24;
    const MESSAGES: u32 = 12;
    let keys: Vec<String> = (0..KEYS).map(|k| format!("order-{k}")).collect();
    write(h.inbox(), &keys, MESSAGES).await;
    let recorder = Recorder::refusing(Duration::from_millis(1), |p| {
        let n: u32 = String::from_utf8_lossy(&p.payload)
            .rsplit_once(':')
            .unwrap()
            .1
            .parse()
            .unwrap();
        p.attempt == 1 && n % 4 == 3
    });
    let options = RelayOptions::default()
        .batch_size(16)
        .workers(3)
        .attempts(10, Duration::from_millis(10))
        .poll_interval(Duration::from_millis(2), Duration::from_millis(20));
    let other = h.inbox_with_pool(4);
    let first = h.inbox().spawn_relay(recorder.clone(), options.clone());
    let second = other.spawn_relay(recorder.clone(), options);
    until_drained(&h).await;
    let (first, second) = (first.shutdown().await, second.shutdown().await);
    assert_no_key_in_flight_twice(&recorder);
    let per_key = published_per_key(&recorder);
    assert_eq!(per_key.len(), KEYS);
    let all: Vec<u32> = (1..=MESSAGES).collect();
    for (key, numbers) in &per_key {
        assert_eq!(numbers, &all, "key {key}: out of order, twice or missing");
    }
    assert_eq!(
        recorder.refused.load(Ordering::SeqCst),
        KEYS * 3,
        "each refused message was tried again only after its refusal"
    );
    assert_eq!(
        (first.published + second.published) as usize,
        KEYS * MESSAGES as usize
    );
}
