//! One bad thing stays one bad thing in the outbox, on every backend: ordering keys whose head the
//! broker refused wait in their back-off without taking a batch's slots from keys that are ready,
//! and keyed writers racing relays never deadlock with them. The broker is the recording
//! [`Recorder`] of `outbox.rs`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::Duration;

use idempotent::outbox::{Destination, Outbox, OutgoingMessage, RelayOptions};

use super::outbox::{Recorder, until_drained};
use crate::support::Harness;

/// An outbox of checkout's message `label` with one message per `(destination, ordering key)`, in
/// that order; the payload is `<label>:<position>`.
fn keyed_outbox(label: &str, messages: &[(&str, &str)]) -> Outbox {
    let mut outbox = Outbox::new("checkout", label).unwrap();
    for (i, (destination, key)) in messages.iter().enumerate() {
        outbox.send(
            OutgoingMessage::new(
                Destination::queue(*destination),
                format!("{label}:{i}").into_bytes(),
            )
            .with_ordering_key(*key),
        );
    }
    outbox
}

/// 50 ordering keys whose first message the broker refuses (each then waits a minute before its
/// next attempt), written first, then a healthy key with three messages. A batch takes at most
/// half as many keys as its size (50 of 100), so keys in back-off, were they counted, would fill
/// every batch and the healthy key would wait until they were parked. It must not: the
/// healthy key's messages go out in the next batches, in order, and the refused keys' second
/// messages still wait behind their heads.
pub async fn keys_in_back_off_take_no_slots_from_ready_keys(h: impl Harness) {
    let inbox = h.inbox();
    let mut tx = inbox.pool().begin().await.unwrap();
    for i in 0..50 {
        let key = format!("refused-{i}");
        let outbox = keyed_outbox(&key, &[("refused", &key), ("orders", &key)]);
        inbox.enqueue(&mut tx, outbox).await.unwrap();
    }
    tx.commit().await.unwrap();
    for i in 0..3 {
        let mut tx = inbox.pool().begin().await.unwrap();
        let outbox = keyed_outbox(&format!("healthy-{i}"), &[("orders", "healthy")]);
        inbox.enqueue(&mut tx, outbox).await.unwrap();
        tx.commit().await.unwrap();
    }
    let recorder = Recorder::refusing(Duration::ZERO, |p| p.destination.routing_key == "refused");
    let options = RelayOptions::default()
        .batch_size(100)
        .attempts(10, Duration::from_secs(60));
    let healthy = || -> Vec<Vec<u8>> {
        recorder
            .published
            .lock()
            .unwrap()
            .iter()
            .filter(|p| p.ordering_key.as_deref() == Some("healthy"))
            .map(|p| p.payload.clone())
            .collect()
    };
    // The healthy key's messages go out in the batches after the first.
    for _ in 0..10 {
        inbox.relay_once(&recorder, &options).await.unwrap();
        if healthy().len() == 3 {
            break;
        }
    }
    assert_eq!(
        healthy(),
        [
            b"healthy-0:0".to_vec(),
            b"healthy-1:0".to_vec(),
            b"healthy-2:0".to_vec()
        ],
        "keys in back-off held up a ready key"
    );
    assert_eq!(recorder.refused.load(Ordering::SeqCst), 50);
    let overtaken = recorder
        .published
        .lock()
        .unwrap()
        .iter()
        .any(|p| p.ordering_key.as_deref() != Some("healthy"));
    assert!(
        !overtaken,
        "a refused key's second message overtook its head"
    );
    let stats = inbox.outbox_stats().await.unwrap();
    assert_eq!((stats.pending, stats.sent, stats.parked), (100, 3, 0));
}

/// Writers of ordering keys racing two relays of two workers each (the second on a pool of its
/// own): eight writers at once, 30 transactions each, every one writing two messages without a key
/// and two of two of 50 shared keys, while the relays take and publish batches of 20 (a broker
/// that takes 5 ms to confirm). No writer fails, not even retryably: a relay's batch must not lock
/// what a writer inserts next to (on InnoDB at `REPEATABLE READ`, the next-key lock a relay's scan
/// leaves on the table's end makes each insert wait for the batch, while the batch waits for a
/// row the writer inserted: a deadlock, or error 1467 from the auto-increment lock). Every message
/// goes out once, each key in its numbers' order.
pub async fn keyed_writers_racing_relays_never_deadlock(h: impl Harness) {
    const WRITERS: usize = 8;
    const ROUNDS: usize = 30;
    const KEYS: usize = 50;
    let recorder = Recorder::new(Duration::from_millis(5));
    let other = h.inbox_with_pool(4);
    let options = RelayOptions::default()
        .batch_size(20)
        .workers(2)
        .poll_interval(Duration::from_millis(1), Duration::from_millis(10));
    let relays = [
        h.inbox().spawn_relay(recorder.clone(), options.clone()),
        other.spawn_relay(recorder.clone(), options),
    ];
    let failures = Mutex::new(Vec::new());
    let writers = (0..WRITERS).map(|w| {
        let (inbox, failures) = (h.inbox(), &failures);
        async move {
            for round in 0..ROUNDS {
                let label = format!("w{w}:{round:02}");
                let keys: Vec<String> = (0..2)
                    .map(|i| format!("key-{}", (w * 7 + round * 3 + i) % KEYS))
                    .collect();
                let mut outbox =
                    keyed_outbox(&label, &[("orders", &keys[0]), ("orders", &keys[1])]);
                for i in 0..2 {
                    outbox.send(OutgoingMessage::new(
                        Destination::queue("plain"),
                        format!("{label}:plain{i}").into_bytes(),
                    ));
                }
                let written = async {
                    let mut tx = inbox.pool().begin().await?;
                    inbox.enqueue(&mut tx, outbox).await?;
                    tx.commit().await?;
                    Ok::<_, Box<dyn std::error::Error>>(())
                };
                if let Err(error) = written.await {
                    failures.lock().unwrap().push(format!("{error:?}"));
                }
            }
        }
    });
    futures::future::join_all(writers).await;
    until_drained(&h).await;
    for relay in relays {
        relay.shutdown().await;
    }
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} of {} keyed writers failed racing the relays: {:?}",
        failures.len(),
        WRITERS * ROUNDS,
        failures.first()
    );
    let rows = h.outbox_rows().await;
    assert_eq!(rows.len(), WRITERS * ROUNDS * 4);
    let seq_of: HashMap<&str, i64> = rows
        .iter()
        .filter_map(|row| Some((row.0.as_str(), row.3?)))
        .collect();
    let counts = recorder.counts();
    assert_eq!(counts.len(), rows.len(), "a message was not published");
    assert!(counts.values().all(|n| *n == 1), "published twice");
    let mut per_key: HashMap<String, Vec<i64>> = HashMap::new();
    for p in recorder.published.lock().unwrap().iter() {
        if let Some(key) = &p.ordering_key {
            per_key
                .entry(key.clone())
                .or_default()
                .push(seq_of[p.message_id.as_str()]);
        }
    }
    for (key, seqs) in per_key {
        let expected: Vec<i64> = (1..=seqs.len() as i64).collect();
        assert_eq!(seqs, expected, "key {key} published out of its order");
    }
}
