//! Keys that stay in order when a message is parked, on every backend: with
//! `RelayOptions::parked_holds_key`, a message the broker refused until it was parked holds its
//! ordering key (the key's later messages wait, other keys go on) until an operator retries it
//! (it goes out first, then the rest in order) or skips it (never published, done as a sent
//! message is: the key goes on, and the purge deletes it after the retention). Without the option
//! the key moves on: `poison_is_parked_never_blocks_the_rest_and_is_retryable_by_hand` in
//! `outbox.rs`. The broker is the recording [`Recorder`] of `outbox.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idempotent::outbox::{Destination, Outbox, OutboxState, OutgoingMessage, RelayOptions};
use idempotent::{Backend, Inbox};

use super::outbox::{Recorder, until_drained};
use crate::support::Harness;

/// The key whose second message the broker refuses while it is closed.
const HELD: &str = "order-7";

/// Writes the messages `numbers` of ordering key `key`, each in a transaction of its own, with the
/// payload `<key>:<number>`.
async fn write<D: Backend>(inbox: &Inbox<D>, key: &str, numbers: std::ops::RangeInclusive<u32>) {
    for n in numbers {
        let label = format!("{key}:{n}");
        let mut outbox = Outbox::new("checkout", label.as_str()).unwrap();
        outbox.send(
            OutgoingMessage::new(Destination::queue("orders"), label.clone().into_bytes())
                .with_ordering_key(key),
        );
        let mut tx = inbox.pool().begin().await.unwrap();
        inbox.enqueue(&mut tx, outbox).await.unwrap();
        tx.commit().await.unwrap();
    }
}

/// The numbers of `key`'s messages the broker confirmed, in the order it confirmed them.
fn published(recorder: &Recorder, key: &str) -> Vec<u32> {
    recorder
        .published
        .lock()
        .unwrap()
        .iter()
        .filter(|p| p.ordering_key.as_deref() == Some(key))
        .map(|p| {
            let payload = String::from_utf8(p.payload.clone()).unwrap();
            payload.rsplit_once(':').unwrap().1.parse().unwrap()
        })
        .collect()
}

/// A broker that refuses the message `<key>:2` of every key in `keys` while `closed` is set.
fn refusing_second(closed: &Arc<AtomicBool>, keys: &[&str]) -> Arc<Recorder> {
    let (closed, refused): (_, Vec<String>) = (
        closed.clone(),
        keys.iter().map(|k| format!("{k}:2")).collect(),
    );
    Recorder::refusing(Duration::ZERO, move |p| {
        closed.load(Ordering::SeqCst) && refused.iter().any(|r| r.as_bytes() == p.payload)
    })
}

fn holding() -> RelayOptions {
    RelayOptions::default()
        .batch_size(10)
        .attempts(2, Duration::from_millis(20))
        .parked_holds_key(true)
}

/// Runs relay batches until one takes nothing while `parked` messages are parked (what is pending
/// then waits behind them), for at most a minute.
async fn until_held<H: Harness>(h: &H, recorder: &Arc<Recorder>, parked: u64) {
    let start = Instant::now();
    loop {
        let report = h.inbox().relay_once(recorder, &holding()).await;
        let report = report.unwrap_or_else(|error| panic!("a relay batch failed: {error}"));
        if report.taken == 0 && h.inbox().outbox_stats().await.unwrap().parked == parked {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the parked messages never settled"
        );
        if report.taken == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Runs relay batches until nothing is pending, for at most a minute.
async fn until_sent<H: Harness>(h: &H, recorder: &Arc<Recorder>) {
    let start = Instant::now();
    while h.inbox().outbox_stats().await.unwrap().pending > 0 {
        let report = h.inbox().relay_once(recorder, &holding()).await.unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the outbox did not drain"
        );
        if report.taken == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Key `order-7` with messages 1..5, the broker refusing its message 2 until it is parked, and key
/// `order-8` with three messages before the park and two after: returns the broker, its switch,
/// and the parked message's row, once the relays took everything they could.
async fn park_the_second_message<H: Harness>(h: &H) -> (Arc<Recorder>, Arc<AtomicBool>, i64) {
    write(h.inbox(), HELD, 1..=5).await;
    write(h.inbox(), "order-8", 1..=3).await;
    let closed = Arc::new(AtomicBool::new(true));
    let recorder = refusing_second(&closed, &[HELD]);
    until_held(h, &recorder, 1).await;
    // Written while the key is held: another key's messages still go out.
    write(h.inbox(), "order-8", 4..=5).await;
    until_held(h, &recorder, 1).await;
    assert_eq!(recorder.refused.load(Ordering::SeqCst), 2);
    assert_eq!(
        published(&recorder, HELD),
        [1],
        "a later message of a held key went out while its head was parked"
    );
    assert_eq!(
        published(&recorder, "order-8"),
        [1, 2, 3, 4, 5],
        "a held key held up another key"
    );
    let stats = h.inbox().outbox_stats().await.unwrap();
    assert_eq!(
        (stats.pending, stats.sent, stats.parked, stats.skipped),
        (3, 6, 1, 0)
    );

    let held = h.inbox().held_keys(None, 10).await.unwrap();
    assert_eq!(held.len(), 1, "{held:?}");
    let key = &held[0];
    assert_eq!(key.ordering_key, HELD);
    assert_eq!(
        (key.parked.state, key.parked.attempts),
        (OutboxState::Parked, 2)
    );
    assert_eq!(key.parked.payload_len, b"order-7:2".len() as u64);
    assert_eq!(key.waiting, 3, "messages 3, 4 and 5 wait behind it");
    assert!(
        key.oldest_waiting
            .is_some_and(|t| t >= key.parked.created_at)
    );
    let row = key.parked.row;
    assert!(
        h.inbox().held_keys(Some(row), 10).await.unwrap().is_empty(),
        "the next page"
    );
    (recorder, closed, row)
}

pub async fn a_parked_message_holds_its_key_and_goes_out_first_once_retried(h: impl Harness) {
    let (recorder, closed, row) = park_the_second_message(&h).await;
    closed.store(false, Ordering::SeqCst);
    assert!(h.inbox().retry_parked(row).await.unwrap());
    assert!(
        !h.inbox().skip_parked(row).await.unwrap(),
        "a retried message is not parked: nothing to skip"
    );
    until_sent(&h, &recorder).await;
    assert_eq!(published(&recorder, HELD), [1, 2, 3, 4, 5]);
    assert!(h.inbox().held_keys(None, 10).await.unwrap().is_empty());
    let record = h.inbox().outbox_message(row).await.unwrap().unwrap();
    assert_eq!(record.state, OutboxState::Sent);
}

pub async fn a_skipped_message_lets_its_key_go_on_and_is_purged_as_sent(h: impl Harness) {
    let (recorder, closed, row) = park_the_second_message(&h).await;
    // The key's row last written more than a second before the skip: a purge with a retention of
    // a second then finds the key old enough and the skipped message not (it counts from the skip).
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(h.inbox().skip_parked(row).await.unwrap());
    assert!(!h.inbox().skip_parked(row).await.unwrap(), "skipped twice");
    assert!(
        !h.inbox().retry_parked(row).await.unwrap(),
        "a skipped message is not parked: nothing to retry"
    );
    closed.store(false, Ordering::SeqCst); // would publish it, were it taken
    until_sent(&h, &recorder).await;
    assert_eq!(published(&recorder, HELD), [1, 3, 4, 5]);
    assert!(h.inbox().held_keys(None, 10).await.unwrap().is_empty());
    let record = h.inbox().outbox_message(row).await.unwrap().unwrap();
    assert_eq!(record.state, OutboxState::Skipped);
    assert!(
        record.sent_at.is_some(),
        "skipped at a time the purge reads"
    );
    let stats = h.inbox().outbox_stats().await.unwrap();
    assert_eq!(
        (stats.pending, stats.sent, stats.parked, stats.skipped),
        (0, 9, 0, 1)
    );

    // A second's retention: the skipped message stays, and its key, untouched for longer and with
    // nothing left to send (a skipped message is done), goes: its next message starts again at 1.
    let recent = h
        .inbox()
        .clone()
        .with_outbox_retention(Duration::from_secs(1));
    recent.purge_expired(100).await.unwrap();
    let record = h.inbox().outbox_message(row).await.unwrap();
    assert_eq!(record.map(|r| r.state), Some(OutboxState::Skipped));
    write(h.inbox(), HELD, 6..=6).await;
    let rows = h.outbox_rows().await;
    let new = rows.iter().find(|row| row.1 == "orders" && row.4 == 0);
    assert_eq!(
        new.and_then(|row| row.3),
        Some(1),
        "the purge kept the key of a skipped message: {rows:?}"
    );
    until_sent(&h, &recorder).await;

    tokio::time::sleep(Duration::from_millis(20)).await;
    let all = h.inbox().clone().with_outbox_retention(Duration::ZERO);
    let report = all.purge_expired(100).await.unwrap();
    assert!(report.outbox_deleted >= 1, "{report:?}");
    assert_eq!(h.inbox().outbox_message(row).await.unwrap(), None);
    assert!(h.outbox_rows().await.is_empty(), "the purge kept a row");
    let stats = h.inbox().outbox_stats().await.unwrap();
    assert_eq!((stats.sent, stats.skipped), (0, 0));
}

/// Two relays of two workers each (the second on a pool of its own) with `parked_holds_key`, over
/// six keys whose second message the broker refuses until it is parked and two keys it takes, 8
/// messages each: no later message of a held key ever goes out while its second is parked, the
/// others all do; once the parked messages are retried, every key went out in order, each message
/// once, and no key was ever in flight twice at once.
pub async fn two_relays_never_let_a_held_keys_later_message_out(h: impl Harness) {
    const HELD_KEYS: [&str; 6] = ["held-0", "held-1", "held-2", "held-3", "held-4", "held-5"];
    const FREE_KEYS: [&str; 2] = ["free-0", "free-1"];
    for key in HELD_KEYS.iter().chain(&FREE_KEYS) {
        write(h.inbox(), key, 1..=8).await;
    }
    let closed = Arc::new(AtomicBool::new(true));
    let recorder = refusing_second(&closed, &HELD_KEYS);
    let options = holding()
        .batch_size(4)
        .workers(2)
        .attempts(3, Duration::from_millis(5))
        .poll_interval(Duration::from_millis(1), Duration::from_millis(10));
    let other = h.inbox_with_pool(4);
    let relays = [
        h.inbox().spawn_relay(recorder.clone(), options.clone()),
        other.spawn_relay(recorder.clone(), options),
    ];
    let start = Instant::now();
    loop {
        let stats = h.inbox().outbox_stats().await.unwrap();
        if stats.parked == HELD_KEYS.len() as u64 && stats.pending == 6 * HELD_KEYS.len() as u64 {
            break;
        }
        for key in HELD_KEYS {
            let out = published(&recorder, key);
            assert!(out.len() <= 1, "{key} let a later message out: {out:?}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the relays never settled: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The relays keep looking meanwhile: a held key stays held.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for key in HELD_KEYS {
        assert_eq!(
            published(&recorder, key),
            [1],
            "{key} let a later message out"
        );
    }
    for key in FREE_KEYS {
        assert_eq!(published(&recorder, key), (1..=8).collect::<Vec<_>>());
    }
    let held = h.inbox().held_keys(None, 100).await.unwrap();
    assert_eq!(held.len(), HELD_KEYS.len());
    assert!(held.iter().all(|k| k.waiting == 6), "{held:?}");

    closed.store(false, Ordering::SeqCst);
    for key in &held {
        assert!(h.inbox().retry_parked(key.parked.row).await.unwrap());
    }
    until_drained(&h).await;
    for relay in relays {
        relay.shutdown().await;
    }
    for key in HELD_KEYS.iter().chain(&FREE_KEYS) {
        assert_eq!(
            published(&recorder, key),
            (1..=8).collect::<Vec<_>>(),
            "{key} out of order"
        );
    }
    assert!(
        recorder.overlaps.lock().unwrap().is_empty(),
        "{:?}",
        recorder.overlaps
    );
}
