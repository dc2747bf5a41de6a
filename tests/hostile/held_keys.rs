//! Hostile tests of parked messages holding their ordering key (`parked_holds_key`,
//! `skip_parked`, `retry_parked`, `held_keys`) on PostgreSQL, with relays running meanwhile.

#[path = "schema.rs"]
mod schema;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent::Inbox;
use idempotent::outbox::{
    Destination, Outbox, OutboxState, OutgoingMessage, Publication, PublishError, Publisher,
    RelayOptions,
};
use sqlx::Postgres;
use sqlx::postgres::PgPoolOptions;

/// Refuses the messages `<key>:2` and `<key>:4` while `closed`, half of the time; records what it
/// confirmed and any key published twice at once.
struct Broker {
    closed: AtomicBool,
    coin: AtomicU64,
    published: Mutex<Vec<(String, u32)>>,
    in_flight: Mutex<HashSet<String>>,
    overlaps: AtomicU64,
}

impl Publisher for Broker {
    async fn publish(&self, p: &Publication) -> Result<(), PublishError> {
        let payload = String::from_utf8(p.payload.clone()).unwrap();
        let (key, n) = payload.rsplit_once(':').unwrap();
        let n: u32 = n.parse().unwrap();
        if !self.in_flight.lock().unwrap().insert(key.to_owned()) {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
        tokio::time::sleep(Duration::from_millis(3)).await;
        self.in_flight.lock().unwrap().remove(key);
        let flip = self.coin.fetch_add(1, Ordering::SeqCst).is_multiple_of(2);
        if self.closed.load(Ordering::SeqCst) && (n == 2 || n == 4) && flip {
            return Err(PublishError::rejected("closed"));
        }
        self.published.lock().unwrap().push((key.to_owned(), n));
        Ok(())
    }
}

async fn inbox(connections: u32) -> Inbox<Postgres> {
    let options = schema::fresh_schema().await;
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .connect_with(options)
        .await
        .unwrap();
    let inbox = Inbox::new(pool);
    inbox.migrate().await.unwrap();
    inbox
}

async fn write(inbox: &Inbox<Postgres>, key: &str, numbers: std::ops::RangeInclusive<u32>) {
    for n in numbers {
        let label = format!("{key}:{n}");
        let mut outbox = Outbox::new("adv", label.as_str()).unwrap();
        outbox.send(
            OutgoingMessage::new(Destination::queue("q"), label.clone().into_bytes())
                .with_ordering_key(key),
        );
        let mut tx = inbox.pool().begin().await.unwrap();
        inbox.enqueue(&mut tx, outbox).await.unwrap();
        tx.commit().await.unwrap();
    }
}

fn holding() -> RelayOptions {
    RelayOptions::default()
        .batch_size(8)
        .workers(2)
        .attempts(2, Duration::from_millis(5))
        .poll_interval(Duration::from_millis(5), Duration::from_millis(20))
        .parked_holds_key(true)
}

/// Two relays holding parked keys run while an operator retries and skips held keys at random
/// for 3 s; then the broker opens and everything parked is retried. Each message is published
/// once or skipped (never both, never neither), each key's publications go in order, and no key
/// is published twice at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_racing_running_relays_keep_each_key_in_order() {
    let inbox = inbox(10).await;
    let keys: Vec<String> = (0..8).map(|k| format!("key{k}")).collect();
    for key in &keys {
        write(&inbox, key, 1..=6).await;
    }
    let broker = Arc::new(Broker {
        closed: AtomicBool::new(true),
        coin: AtomicU64::new(0),
        published: Mutex::default(),
        in_flight: Mutex::default(),
        overlaps: AtomicU64::new(0),
    });
    let relays = [
        inbox.spawn_relay(broker.clone(), holding()),
        inbox.spawn_relay(broker.clone(), holding()),
    ];
    let started = Instant::now();
    let mut skipped_by_us = HashSet::new();
    let mut turn = 0u64;
    while started.elapsed() < Duration::from_secs(3) {
        for held in inbox.held_keys(None, 100).await.unwrap() {
            turn += 1;
            let row = held.parked.row;
            if turn.is_multiple_of(3) {
                if inbox.skip_parked(row).await.unwrap() {
                    skipped_by_us.insert(row);
                }
            } else {
                // Retry and skip at once: at most one of them may win.
                let (retried, skipped) =
                    tokio::join!(inbox.retry_parked(row), inbox.skip_parked(row));
                let (retried, skipped) = (retried.unwrap(), skipped.unwrap());
                assert!(!(retried && skipped), "row {row} both retried and skipped");
                if skipped {
                    skipped_by_us.insert(row);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    broker.closed.store(false, Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        for parked in inbox.parked_messages(None, 1000).await.unwrap() {
            inbox.retry_parked(parked.row).await.unwrap();
        }
        let stats = inbox.outbox_stats().await.unwrap();
        if stats.pending == 0 && stats.parked == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "not drained: {stats:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for relay in relays {
        relay.shutdown().await;
    }
    let published = broker.published.lock().unwrap().clone();
    let mut by_key: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for (key, n) in &published {
        by_key.entry(key.clone()).or_default().push(*n);
    }
    let mut skipped: HashMap<String, Vec<u32>> = HashMap::new();
    for key in &keys {
        for n in 1..=6 {
            let records = inbox
                .outbox_messages(&outbox_id(&inbox, key, n).await)
                .await
                .unwrap();
            assert_eq!(records.len(), 1);
            let record = &records[0];
            match record.state {
                OutboxState::Skipped => {
                    assert!(skipped_by_us.contains(&record.row));
                    skipped.entry(key.clone()).or_default().push(n);
                }
                OutboxState::Sent => {}
                state => panic!("{key}:{n} left {state:?}"),
            }
        }
    }
    for key in &keys {
        let sent = by_key.get(key).cloned().unwrap_or_default();
        let gone = skipped.get(key).cloned().unwrap_or_default();
        let mut sorted = sent.clone();
        sorted.sort();
        assert_eq!(
            sent, sorted,
            "{key} out of order: {sent:?} (skipped {gone:?})"
        );
        let mut all: Vec<u32> = sent.iter().chain(&gone).copied().collect();
        all.sort();
        assert_eq!(
            all,
            (1..=6).collect::<Vec<_>>(),
            "{key}: sent {sent:?} skipped {gone:?}"
        );
    }
    assert_eq!(broker.overlaps.load(Ordering::SeqCst), 0);
    eprintln!(
        "skipped {} rows; published {}",
        skipped_by_us.len(),
        published.len()
    );
}

/// The message id of `<key>:<n>`, from its row.
async fn outbox_id(inbox: &Inbox<Postgres>, key: &str, n: u32) -> String {
    sqlx::query_scalar("SELECT message_id FROM idempotent_inbox_outbox WHERE payload = $1")
        .bind(format!("{key}:{n}").into_bytes())
        .fetch_one(inbox.pool())
        .await
        .unwrap()
}

/// `held_keys` pages over 25 held keys 7 at a time: each key once, in row order; a key parked
/// twice (by a relay without the option) shows once; unkeyed parked rows never show.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_keys_pages_each_key_once() {
    let inbox = inbox(4).await;
    for k in 0..25 {
        write(&inbox, &format!("page{k:02}"), 1..=3).await;
    }
    // Unkeyed messages, refused too.
    for n in 0..5 {
        let mut outbox = Outbox::new("adv", format!("unkeyed{n}").as_str()).unwrap();
        outbox.send(OutgoingMessage::new(
            Destination::queue("q"),
            b"unkeyed:9".to_vec(),
        ));
        let mut tx = inbox.pool().begin().await.unwrap();
        inbox.enqueue(&mut tx, outbox).await.unwrap();
        tx.commit().await.unwrap();
    }
    // First a relay WITHOUT the option that refuses 1 and 3 (key parked twice), then the 2s go.
    struct Refuse(&'static [u32]);
    impl Publisher for Refuse {
        async fn publish(&self, p: &Publication) -> Result<(), PublishError> {
            let payload = String::from_utf8(p.payload.clone()).unwrap();
            let n: u32 = payload.rsplit_once(':').unwrap().1.parse().unwrap();
            if self.0.contains(&n) {
                return Err(PublishError::rejected("no"));
            }
            Ok(())
        }
    }
    let options = RelayOptions::default()
        .batch_size(50)
        .attempts(1, Duration::from_millis(1));
    for _ in 0..20 {
        inbox
            .relay_once(&Refuse(&[1, 3, 9]), &options)
            .await
            .unwrap();
    }
    let stats = inbox.outbox_stats().await.unwrap();
    assert_eq!(stats.parked, 55, "{stats:?}");
    let mut pages = Vec::new();
    let mut after = None;
    loop {
        let page = inbox.held_keys(after, 7).await.unwrap();
        if page.is_empty() {
            break;
        }
        after = Some(page.last().unwrap().parked.row);
        pages.extend(page);
        assert!(pages.len() <= 25, "paging does not end");
    }
    let keys: Vec<&str> = pages.iter().map(|h| h.ordering_key.as_str()).collect();
    let expected: Vec<String> = (0..25).map(|k| format!("page{k:02}")).collect();
    assert_eq!(keys, expected);
    for held in &pages {
        // Behind the parked 1: the parked 3 (the 2 was sent).
        assert_eq!(held.waiting, 1, "{held:?}");
    }
    // Skip the first of a key parked twice: the key is held again, by its 3.
    let first = &pages[0];
    assert!(inbox.skip_parked(first.parked.row).await.unwrap());
    assert!(
        !inbox.skip_parked(first.parked.row).await.unwrap(),
        "skipped twice"
    );
    assert!(
        !inbox.retry_parked(first.parked.row).await.unwrap(),
        "a skipped row retried"
    );
    let again = inbox.held_keys(None, 1).await.unwrap();
    assert_eq!(again[0].ordering_key, "page00");
    assert_ne!(again[0].parked.row, first.parked.row);
    assert_eq!(again[0].waiting, 0);
    // Negative and huge `after`, a limit of 0: no panic, no error.
    assert_eq!(inbox.held_keys(Some(-5), 0).await.unwrap().len(), 1);
    assert!(
        inbox
            .held_keys(Some(i64::MAX), usize::MAX)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(!inbox.skip_parked(i64::MIN).await.unwrap());
}
