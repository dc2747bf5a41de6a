//! The transactional outbox on every backend: outgoing rows commit with the handler's effect or not
//! at all, with ids that a rerun reproduces; relays never publish one row at once, keep each
//! ordering key in commit order, park what the broker keeps refusing, and the purge keeps what it
//! must. The broker here is a recording [`Publisher`]; `tests/brokers/outbox/` runs the real ones.

use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use idempotent::outbox::{
    Destination, Outbox, OutboxState, OutgoingMessage, Publication, PublishError, Publisher,
    RelayOptions, RelayReport, RelayStats,
};
use idempotent::{Backend, Error, Handled, Inbox, InboxError, message_key};

use super::run_until_pending;
use crate::support::{Behaviour, Delivery, Harness, Outgoing, Step};

/// A broker that records every publication, checks that no message and no ordering key is ever in
/// flight twice at once, takes `delay` to confirm, and refuses what `refuses` says.
pub struct Recorder {
    delay: Duration,
    refuses: Box<dyn Fn(&Publication) -> bool + Send + Sync>,
    in_flight: Mutex<(HashSet<String>, HashSet<String>)>,
    /// Every confirmed publication, in the order the confirmations came.
    pub published: Mutex<Vec<Publication>>,
    /// Publications that found their message (or their ordering key) in flight already.
    pub overlaps: Mutex<Vec<String>>,
    pub refused: AtomicUsize,
}

impl Recorder {
    pub fn new(delay: Duration) -> Arc<Self> {
        Self::refusing(delay, |_| false)
    }

    pub fn refusing(
        delay: Duration,
        refuses: impl Fn(&Publication) -> bool + Send + Sync + 'static,
    ) -> Arc<Self> {
        Arc::new(Self {
            delay,
            refuses: Box::new(refuses),
            in_flight: Mutex::default(),
            published: Mutex::default(),
            overlaps: Mutex::default(),
            refused: AtomicUsize::new(0),
        })
    }

    /// How many times each message id was confirmed.
    pub fn counts(&self) -> HashMap<String, usize> {
        let mut counts = HashMap::new();
        for publication in self.published.lock().unwrap().iter() {
            *counts.entry(publication.message_id.clone()).or_default() += 1;
        }
        counts
    }
}

impl Publisher for Recorder {
    async fn publish(&self, publication: &Publication) -> Result<(), PublishError> {
        let key = publication.ordering_key.clone();
        {
            let mut in_flight = self.in_flight.lock().unwrap();
            if !in_flight.0.insert(publication.message_id.clone()) {
                self.overlaps
                    .lock()
                    .unwrap()
                    .push(format!("message {}", publication.message_id));
            }
            if let Some(key) = &key
                && !in_flight.1.insert(key.clone())
            {
                self.overlaps.lock().unwrap().push(format!("key {key}"));
            }
        }
        tokio::time::sleep(self.delay).await;
        let refused = (self.refuses)(publication);
        {
            let mut in_flight = self.in_flight.lock().unwrap();
            in_flight.0.remove(&publication.message_id);
            if let Some(key) = &key {
                in_flight.1.remove(key);
            }
        }
        if refused {
            self.refused.fetch_add(1, Ordering::SeqCst);
            return Err(PublishError::rejected(
                "no queue is bound to this routing key",
            ));
        }
        self.published.lock().unwrap().push(publication.clone());
        Ok(())
    }
}

fn options() -> RelayOptions {
    RelayOptions::default()
        .batch_size(10)
        .poll_interval(Duration::from_millis(5), Duration::from_millis(50))
}

/// Runs one relay batch, again while it fails with an error worth retrying, as the relay's loop
/// does: a batch may meet the row locks of a session the server has not yet seen end (one whose
/// batch a test dropped), which MariaDB and Galera answer with a deadlock. For at most a minute;
/// each batch within 30 s (a pool of one that never got its connection back hangs it).
async fn relay_batch<D: Backend, P: Publisher>(
    inbox: &Inbox<D>,
    publisher: &P,
    options: &RelayOptions,
) -> RelayReport {
    let start = Instant::now();
    loop {
        let batch = inbox.relay_once(publisher, options);
        let batch = tokio::time::timeout(Duration::from_secs(30), batch).await;
        match batch.expect("a relay batch hung: its pool never gave it a connection") {
            Ok(report) => return report,
            Err(error) if error.is_retryable() && start.elapsed() < Duration::from_secs(60) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(error) => panic!("a relay batch failed: {error}"),
        }
    }
}

/// Runs relay batches until the outbox has no pending message left, for at most a minute.
async fn drain<H: Harness>(h: &H, publisher: &Arc<Recorder>, options: &RelayOptions) {
    let start = Instant::now();
    loop {
        let report = relay_batch(h.inbox(), publisher, options).await;
        if report.taken == 0 && h.inbox().outbox_stats().await.unwrap().pending == 0 {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the outbox did not drain"
        );
        if report.taken == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// Waits until no outgoing message is pending, for at most a minute.
pub async fn until_drained<H: Harness>(h: &H) {
    let start = Instant::now();
    while h.inbox().outbox_stats().await.unwrap().pending > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the relays did not drain the outbox"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub async fn rolled_back_body_leaves_no_outgoing_row(h: impl Harness) {
    let sending = |label: &str, behaviour: Behaviour| {
        Delivery::new(label).behaving(behaviour).sending(Outgoing {
            count: 2,
            ..Outgoing::default()
        })
    };
    let error = h
        .deliver_notifier(&sending("fails", Behaviour::Fail))
        .await
        .unwrap_err();
    assert!(matches!(error, Error::Handler(_)), "{error:?}");
    let panicked = AssertUnwindSafe(h.deliver_notifier(&sending("panics", Behaviour::Panic)))
        .catch_unwind()
        .await;
    assert!(panicked.is_err());
    let started = Arc::new(tokio::sync::Notify::new());
    let hanging = sending("cancelled", Behaviour::Hang(started.clone()));
    tokio::select! {
        outcome = h.deliver_notifier(&hanging) => {
            panic!("a hanging body returned {outcome:?}")
        }
        () = started.notified() => {} // the messages are queued, the effect written: drop it here
    }
    assert!(
        h.outbox_rows().await.is_empty(),
        "a rolled-back body left outgoing rows"
    );

    // A duplicate's body does not run: it queues nothing.
    let paid = sending("paid", Behaviour::Succeed);
    assert!(h.deliver_notifier(&paid).await.unwrap().is_processed());
    assert!(h.deliver_notifier(&paid).await.unwrap().is_duplicate());
    assert_eq!(h.outbox_rows().await.len(), 2);
}

pub async fn committed_body_leaves_exactly_its_rows(h: impl Harness) {
    let outgoing = Outgoing {
        count: 3,
        ..Outgoing::default()
    };
    let msg = Delivery::new("order-paid").sending(outgoing.clone());
    assert!(h.deliver_notifier(&msg).await.unwrap().is_processed());
    let key = message_key("order-paid").unwrap();
    let expected: Vec<String> = (0..3)
        .map(|i| Outbox::derived_id("notifier", &key, i))
        .collect();
    assert_eq!(*outgoing.ids.lock().unwrap(), expected);
    let rows = h.outbox_rows().await;
    let ids: Vec<&str> = rows.iter().map(|row| row.0.as_str()).collect();
    assert_eq!(ids, expected);
    for row in &rows {
        assert_eq!(
            (row.1.as_str(), row.4, row.5.as_str()),
            ("notifications", 0, "notifier")
        );
    }
    assert_eq!(h.effects_of("notifier", "order-paid").await, 1);

    // What a relay hands the broker is what the body queued.
    let recorder = Recorder::new(Duration::ZERO);
    drain(&h, &recorder, &options()).await;
    let published = recorder.published.lock().unwrap().clone();
    let mut seen: Vec<Seen> = published
        .iter()
        .map(|p| {
            assert_eq!(p.destination, Destination::queue("notifications"));
            (
                p.message_id.clone(),
                p.payload.clone(),
                p.headers.clone(),
                p.attempt,
            )
        })
        .collect();
    seen.sort();
    let mut queued: Vec<_> = expected
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let header = vec![("label".to_owned(), "order-paid".to_owned())];
            (
                id.clone(),
                format!("order-paid#{i}").into_bytes(),
                header,
                1,
            )
        })
        .collect();
    queued.sort();
    assert_eq!(seen, queued);
    let stats = h.inbox().outbox_stats().await.unwrap();
    assert_eq!((stats.pending, stats.sent, stats.parked), (0, 3, 0));
    // Nothing is published twice without a crash.
    assert!(
        h.inbox()
            .relay_once(&recorder, &options())
            .await
            .unwrap()
            .taken
            == 0
    );
    assert_eq!(recorder.published.lock().unwrap().len(), 3);
}

/// A body that queues outgoing messages and then ends the inbox's transaction itself (`ROLLBACK`,
/// `COMMIT`, `COMMIT` then `BEGIN`), or swallows a failed statement: never `Processed` (but for a
/// swallowed failure where the transaction survives it, with everything committed), however many
/// messages it queued and whether they have an ordering key. An ended transaction is
/// `TransactionEnded` whatever became of the rows written after the end (written on their own,
/// refused, or lost to a pooler in transaction mode); a swallowed failure's other error comes only
/// with nothing committed. (On PostgreSQL the last
/// outgoing row's `INSERT` is what proves the transaction before the commit, in place of a read of
/// its own: a row written outside the inbox's transaction must prove nothing.) A redelivery then
/// finds what the error said.
pub async fn body_with_outgoing_messages_that_ends_its_transaction_is_never_processed(
    h: impl Harness,
) {
    let endings: [(&str, &[&'static str]); 5] = [
        ("rollback", &["ROLLBACK"]),
        ("commit", &["COMMIT"]),
        ("commit-begin", &["COMMIT", "BEGIN"]),
        (
            "commit-begin-fail",
            &["COMMIT", "BEGIN", "INSERT INTO uniques (id) VALUES (1)"],
        ),
        ("swallowed", &["INSERT INTO uniques (id) VALUES (1)"]),
    ];
    for (ending, end) in endings {
        for (count, keyed) in [(1, false), (2, false), (1, true)] {
            let label = format!("sends-{ending}-{count}-{keyed}");
            let mut steps = vec![Step::Effect("before")];
            steps.extend(end.iter().map(|sql| Step::Sql(sql)));
            steps.push(Step::Effect("after"));
            let outgoing = Outgoing {
                count,
                ordering_key: keyed.then(|| format!("key-{label}")),
                ..Outgoing::default()
            };
            let msg = Delivery::new(&label)
                .behaving(Behaviour::Script(steps))
                .sending(outgoing.clone());
            let outcome = h.deliver_notifier(&msg).await;
            let processed = h.inbox().is_processed("notifier", &label).await.unwrap();
            let ids = outgoing.ids.lock().unwrap().clone();
            let rows = h.outbox_rows().await;
            let written = rows.iter().filter(|row| ids.contains(&row.0)).count();
            let facts =
                format!("{label}: {outcome:?}; key committed: {processed}, rows: {written}");
            let key_committed = match outcome {
                Err(Error::Inbox(InboxError::TransactionEnded { key_committed, .. })) => {
                    assert_eq!(key_committed, processed, "{facts}");
                    key_committed
                }
                // A swallowed failure: the transaction survives it (MySQL, SQLite) and commits
                // whole.
                Ok(Handled::Processed(())) if ending == "swallowed" => {
                    assert!(processed && written == count, "{facts}");
                    true
                }
                // Any other error, for a swallowed failure only (the outgoing row's insert
                // refused in the aborted transaction): nothing committed, so that the redelivery
                // runs the body again.
                Err(error)
                    if ending == "swallowed"
                        && !matches!(error, Error::Inbox(InboxError::TransactionEnded { .. })) =>
                {
                    assert!(!processed && written == 0, "{facts}");
                    false
                }
                other => panic!("{facts}: a body that ended its transaction, reported {other:?}"),
            };
            let retry = h
                .deliver_notifier(&Delivery::new(&label).sending(outgoing))
                .await;
            match retry {
                Ok(Handled::Duplicate { .. }) => assert!(key_committed, "{facts}"),
                Ok(Handled::Processed(())) => assert!(!key_committed, "{facts}"),
                other => panic!("{facts}: the redelivery failed: {other:?}"),
            }
        }
    }
}

pub async fn rerun_after_rollback_yields_the_same_ids(h: impl Harness) {
    let failed = Outgoing {
        count: 2,
        ..Outgoing::default()
    };
    let msg = Delivery::new("retried").behaving(Behaviour::Fail);
    h.deliver_notifier(&msg.clone().sending(failed.clone()))
        .await
        .unwrap_err();
    let committed = Outgoing {
        count: 2,
        ..Outgoing::default()
    };
    let msg = Delivery::new("retried").sending(committed.clone());
    assert!(h.deliver_notifier(&msg).await.unwrap().is_processed());
    let first = failed.ids.lock().unwrap().clone();
    assert_eq!(first, *committed.ids.lock().unwrap());
    let stored: Vec<String> = h.outbox_rows().await.into_iter().map(|row| row.0).collect();
    assert_eq!(stored, first);
    // Another consumer, or another message, gets other ids.
    assert_ne!(
        Outbox::derived_id("mailer", &message_key("retried").unwrap(), 0),
        first[0]
    );
}

pub async fn outgoing_rows_commit_with_the_callers_own_transaction(h: impl Harness) {
    let outbox = || {
        let mut outbox = Outbox::new("checkout", "order-1").unwrap();
        outbox.send(OutgoingMessage::new(
            Destination::subject("orders.created"),
            b"{}".to_vec(),
        ));
        outbox.send(
            OutgoingMessage::new(
                Destination::exchange("shop", "order.created"),
                b"{}".to_vec(),
            )
            .with_id("order-1-created"),
        );
        outbox
    };
    let ids: Vec<String> = outbox().messages().map(|(id, _)| id.to_owned()).collect();
    assert_eq!(
        ids,
        [
            Outbox::derived_id("checkout", &message_key("order-1").unwrap(), 0),
            "order-1-created".to_owned()
        ]
    );
    let mut tx = h.inbox().pool().begin().await.unwrap();
    h.inbox().enqueue(&mut tx, outbox()).await.unwrap();
    tx.rollback().await.unwrap();
    assert!(
        h.outbox_rows().await.is_empty(),
        "a rolled-back transaction left rows"
    );

    let mut tx = h.inbox().pool().begin().await.unwrap();
    h.inbox().enqueue(&mut tx, outbox()).await.unwrap();
    tx.commit().await.unwrap();
    let rows = h.outbox_rows().await;
    let stored: Vec<(&str, &str, &str)> = rows
        .iter()
        .map(|row| (row.0.as_str(), row.1.as_str(), row.5.as_str()))
        .collect();
    assert_eq!(
        stored,
        [
            (ids[0].as_str(), "orders.created", "checkout"),
            ("order-1-created", "order.created", "checkout")
        ]
    );
    let found = h.inbox().outbox_messages("order-1-created").await.unwrap();
    assert_eq!(found.len(), 1);
    assert_eq!(
        found[0].destination,
        Destination::exchange("shop", "order.created")
    );
    assert_eq!(found[0].state, OutboxState::Pending);
}

pub async fn unusable_outgoing_message_fails_the_handler_and_commits_nothing(h: impl Harness) {
    let nowhere = Outgoing {
        count: 2,
        destination: String::new(),
        ..Outgoing::default()
    };
    let error = h
        .deliver_notifier(&Delivery::new("nowhere").sending(nowhere))
        .await
        .unwrap_err();
    assert!(
        matches!(
            error,
            Error::Inbox(InboxError::Outgoing { position: 0, .. })
        ),
        "{error:?}"
    );
    assert!(!error.is_retryable());
    assert_eq!(h.effects_of("notifier", "nowhere").await, 0);
    assert!(!h.inbox().is_processed("notifier", "nowhere").await.unwrap());
    assert!(h.outbox_rows().await.is_empty());
}

/// Handles 40 messages, each queueing one outgoing message (every fourth with one of three ordering
/// keys when `keyed`), then drains the outbox with two relays of two workers each, the second on a
/// pool of its own (on Galera, another node), through a broker that takes 15 ms to confirm.
pub async fn two_relays_drain_forty_messages<H: Harness>(
    h: &H,
    keyed: bool,
) -> (Arc<Recorder>, RelayStats, RelayStats) {
    for i in 0..40 {
        let mut outgoing = Outgoing::default();
        if keyed && i % 4 == 0 {
            outgoing.ordering_key = Some(format!("key-{}", i % 3));
        }
        let msg = Delivery::new(&format!("m{i}")).sending(outgoing);
        assert!(h.deliver_notifier(&msg).await.unwrap().is_processed());
    }
    let recorder = Recorder::new(Duration::from_millis(15));
    let options = RelayOptions::default()
        .batch_size(4)
        .workers(2)
        .poll_interval(Duration::from_millis(5), Duration::from_millis(20));
    let other = h.inbox_with_pool(4);
    let first = h.inbox().spawn_relay(recorder.clone(), options.clone());
    let second = other.spawn_relay(recorder.clone(), options);
    until_drained(h).await;
    let (first, second) = (first.shutdown().await, second.shutdown().await);
    (recorder, first, second)
}

pub async fn two_relays_never_publish_one_row_at_once(h: impl Harness) {
    let (recorder, first, second) = two_relays_drain_forty_messages(&h, true).await;
    assert!(
        recorder.overlaps.lock().unwrap().is_empty(),
        "{:?}",
        recorder.overlaps
    );
    let counts = recorder.counts();
    assert_eq!(counts.len(), 40);
    assert!(
        counts.values().all(|n| *n == 1),
        "published twice: {counts:?}"
    );
    assert_eq!(first.published + second.published, 40);
    // The relays ran side by side, each skipping the rows the other held (where the database
    // lets two transactions write at once).
    assert!(
        h.one_writer() || (first.published > 0 && second.published > 0),
        "one relay did all the work: {first:?} {second:?}"
    );
    let rows = h.outbox_rows().await;
    assert!(
        rows.iter().all(|row| row.4 == 1),
        "a row is not marked sent"
    );
}

pub async fn ordering_per_key_holds_under_concurrent_producers(h: impl Harness) {
    const PRODUCERS: usize = 4;
    const MESSAGES: usize = 12;
    const KEYS: usize = 3;
    let recorder = Recorder::new(Duration::from_millis(2));
    let other = h.inbox_with_pool(4);
    let options = RelayOptions::default()
        .batch_size(8)
        .poll_interval(Duration::from_millis(2), Duration::from_millis(20));
    let relays = [
        h.inbox().spawn_relay(recorder.clone(), options.clone()),
        other.spawn_relay(recorder.clone(), options),
    ];
    // Each producer handles its messages one after another, so its messages of one key commit in
    // its order; the producers run at once.
    let producers = (0..PRODUCERS).map(|p| {
        let h = &h;
        async move {
            for i in 0..MESSAGES {
                let outgoing = Outgoing {
                    ordering_key: Some(format!("order-{}", (p + i) % KEYS)),
                    ..Outgoing::default()
                };
                let msg = Delivery::new(&format!("p{p}:{i:02}")).sending(outgoing);
                loop {
                    match h.deliver_notifier(&msg).await {
                        Ok(handled) => {
                            assert!(handled.is_processed());
                            break;
                        }
                        // InnoDB may pick a waiting producer as a deadlock victim: try again.
                        Err(error) if error.is_retryable() => continue,
                        Err(error) => panic!("{error:?}"),
                    }
                }
            }
        }
    });
    futures::future::join_all(producers).await;
    until_drained(&h).await;
    for relay in relays {
        relay.shutdown().await;
    }
    assert!(
        recorder.overlaps.lock().unwrap().is_empty(),
        "{:?}",
        recorder.overlaps
    );
    let published = recorder.published.lock().unwrap().clone();
    assert_eq!(published.len(), PRODUCERS * MESSAGES);
    // Per key: the order of publication is the order of the keys' numbers, without a gap, and
    // every producer's messages come in the order it committed them.
    let rows = h.outbox_rows().await;
    let seq_of: HashMap<&str, i64> = rows
        .iter()
        .map(|row| (row.0.as_str(), row.3.expect("a keyed row has a number")))
        .collect();
    let mut per_key: HashMap<String, Vec<&Publication>> = HashMap::new();
    for publication in &published {
        let key = publication.ordering_key.clone().expect("keyed");
        per_key.entry(key).or_default().push(publication);
    }
    assert_eq!(per_key.len(), KEYS);
    for (key, publications) in per_key {
        let seqs: Vec<i64> = publications
            .iter()
            .map(|p| seq_of[p.message_id.as_str()])
            .collect();
        let expected: Vec<i64> = (1..=publications.len() as i64).collect();
        assert_eq!(seqs, expected, "key {key} published out of its order");
        let mut last: HashMap<&str, &str> = HashMap::new();
        for p in &publications {
            let label = p.headers[0].1.as_str();
            let (producer, i) = label.split_once(':').unwrap();
            if let Some(before) = last.insert(producer, i) {
                assert!(
                    before < i,
                    "key {key}: {producer}'s {i} published after its {before}"
                );
            }
        }
    }
}

/// An outbox of checkout's message `label`, one outgoing message with ordering key `order-9` whose
/// payload is the label.
pub fn keyed(label: &str) -> Outbox {
    let mut outbox = Outbox::new("checkout", label).unwrap();
    outbox.send(
        OutgoingMessage::new(Destination::queue("orders"), label.as_bytes().to_vec())
            .with_ordering_key("order-9"),
    );
    outbox
}

/// Drains the outbox with relay batches; the payloads in the order the broker confirmed them.
pub async fn drained_payloads<H: Harness>(h: &H) -> Vec<Vec<u8>> {
    let recorder = Recorder::new(Duration::ZERO);
    drain(h, &recorder, &options()).await;
    let published = recorder.published.lock().unwrap();
    published.iter().map(|p| p.payload.clone()).collect()
}

/// A transaction holding a message of a key makes a second writer of that key wait for its commit;
/// the relay then publishes them in commit order (a row written first but committed second must
/// not go out first).
pub async fn a_second_writer_of_an_ordering_key_waits_for_the_first_commit(h: impl Harness) {
    let mut first = h.inbox().pool().begin().await.unwrap();
    h.inbox().enqueue(&mut first, keyed("first")).await.unwrap();
    let other = h.inbox_with_pool(2);
    let second_done = Arc::new(AtomicUsize::new(0));
    let second = {
        let other = other.clone();
        let second_done = second_done.clone();
        tokio::spawn(async move {
            let mut second = other.pool().begin().await.unwrap();
            let written = other.enqueue(&mut second, keyed("second")).await;
            second_done.store(1, Ordering::SeqCst);
            written.unwrap();
            second.commit().await.unwrap();
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        second_done.load(Ordering::SeqCst),
        0,
        "the second writer of the key did not wait for the first transaction"
    );
    first.commit().await.unwrap();
    second.await.unwrap();
    assert_eq!(
        drained_payloads(&h).await,
        [b"first".to_vec(), b"second".to_vec()]
    );
}

/// A handler queueing two messages of one ordering key, dropped after each of its first `n` polls
/// that returned `Pending` (every await point of the claim, the body, the outgoing rows' writes
/// and the commit), on an inbox whose pool has one connection: every message ends with its two
/// rows, written once, and the key's numbers run 1, 2, … without a gap or a repeat (a dropped
/// transaction's number goes back with it).
pub async fn handler_with_an_outbox_dropped_at_every_await_point_writes_its_rows_once(
    h: impl Harness,
) {
    let inbox = h.inbox_of_one();
    let messages = super::sweep_until_several_drops(async |sweep| {
        drop_an_outbox_handler_at_every_await_point(&h, &inbox, sweep).await
    })
    .await;
    let rows = h.outbox_rows().await;
    assert_eq!(rows.len(), 2 * messages, "rows written twice or lost");
    let ids: HashSet<&str> = rows.iter().map(|row| row.0.as_str()).collect();
    assert_eq!(ids.len(), rows.len(), "an id written twice");
    let mut seqs: Vec<i64> = rows.iter().map(|row| row.3.expect("keyed")).collect();
    seqs.sort_unstable();
    let expected: Vec<i64> = (1..=rows.len() as i64).collect();
    assert_eq!(seqs, expected, "the key's numbers have a gap or a repeat");
}

/// One sweep of [`handler_with_an_outbox_dropped_at_every_await_point_writes_its_rows_once`]: how
/// many times the handler was dropped before a call ran to its end.
async fn drop_an_outbox_handler_at_every_await_point<H: Harness>(
    h: &H,
    inbox: &Inbox<H::Db>,
    sweep: usize,
) -> usize {
    let outgoing = || Outgoing {
        count: 2,
        ordering_key: Some("dropped".into()),
        ..Outgoing::default()
    };
    let mut drops = 0;
    for n in 1.. {
        let msg = Delivery::new(&format!("dropped-{sweep}-{n}")).sending(outgoing());
        let finished = run_until_pending(h.deliver_notifier_on(inbox, &msg), n).await;
        let again = Delivery::new(&msg.label).sending(outgoing());
        let outcome = tokio::time::timeout(
            Duration::from_secs(30),
            h.deliver_notifier_on(inbox, &again),
        )
        .await
        .unwrap_or_else(|_| panic!("after a drop at await point {n}, the pool of one hung"))
        .unwrap_or_else(|error| panic!("after a drop at await point {n}: {error:?}"));
        assert_eq!(h.effects_of("notifier", &msg.label).await, 1, "{n}");
        if let Some(finished) = finished {
            assert!(finished.unwrap().is_processed());
            assert!(outcome.is_duplicate(), "{outcome:?}");
            break;
        }
        drops += 1;
    }
    drops
}

/// A relay batch dropped after each of its first `n` polls that returned `Pending` (taking the rows,
/// each publication, marking them, the commit), on an inbox whose pool has one connection: the
/// pool of one keeps working, no row is lost, and every row ends sent; a row whose batch was
/// dropped after the broker confirmed it may go out again (under its id), never one never sent.
pub async fn relay_batch_dropped_at_every_await_point_loses_no_row(h: impl Harness) {
    for i in 0..6 {
        let msg = Delivery::new(&format!("m{i}")).sending(Outgoing::default());
        assert!(h.deliver_notifier(&msg).await.unwrap().is_processed());
    }
    let inbox = h.inbox_of_one();
    let recorder = Recorder::new(Duration::from_millis(1));
    let options = RelayOptions::default().batch_size(3);
    let mut drops = 0;
    for n in 1.. {
        let finished = run_until_pending(inbox.relay_once(&recorder, &options), n).await;
        match finished {
            Some(Ok(report)) if report.taken == 0 => break,
            Some(Ok(_)) => {}
            // The locks of the batch dropped before this one (see `relay_batch`): the next
            // sweep's batch tries again.
            Some(Err(error)) if error.is_retryable() => {}
            Some(Err(error)) => panic!("a relay batch failed: {error}"),
            None => drops += 1,
        }
        assert!(n < 10_000, "the relay never finished a batch");
    }
    assert!(drops > 2, "the batch had only {drops} await points");
    // The pool of one still works (`relay_batch` fails a batch that hangs); rows a dropped batch
    // held until the server saw its session end go out now.
    relay_batch(&inbox, &recorder, &options).await;
    drain(&h, &recorder, &options).await;
    let rows = h.outbox_rows().await;
    assert_eq!(rows.len(), 6);
    assert!(
        rows.iter().all(|row| row.4 == 1),
        "a row is not marked sent"
    );
    let counts = recorder.counts();
    for row in &rows {
        assert!(
            counts.get(&row.0).is_some_and(|n| *n >= 1),
            "{} never published",
            row.0
        );
    }
}

pub async fn poison_is_parked_never_blocks_the_rest_and_is_retryable_by_hand(h: impl Harness) {
    let poison = Outgoing {
        destination: "nowhere".into(),
        ordering_key: Some("order-5".into()),
        ..Outgoing::default()
    };
    assert!(
        h.deliver_notifier(&Delivery::new("poison").sending(poison.clone()))
            .await
            .unwrap()
            .is_processed()
    );
    let after = Outgoing {
        ordering_key: Some("order-5".into()),
        ..Outgoing::default()
    };
    let msg = Delivery::new("after-poison").sending(after.clone());
    assert!(h.deliver_notifier(&msg).await.unwrap().is_processed());
    for i in 0..5 {
        let msg = Delivery::new(&format!("good-{i}"));
        assert!(h.deliver_notifier(&msg).await.unwrap().is_processed());
    }
    let closed = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let refusing = closed.clone();
    let recorder = Recorder::refusing(Duration::ZERO, move |p| {
        refusing.load(Ordering::SeqCst) && p.destination.routing_key == "nowhere"
    });
    let options = options().attempts(3, Duration::from_millis(50));
    // The good ones go out at once; the poison's key waits behind it while it is retried.
    h.inbox().relay_once(&recorder, &options).await.unwrap();
    let published = |r: &Recorder| -> Vec<String> {
        r.published
            .lock()
            .unwrap()
            .iter()
            .map(|p| p.message_id.clone())
            .collect()
    };
    assert_eq!(published(&recorder).len(), 5, "the poison held up the rest");
    assert!(!published(&recorder).contains(&after.ids.lock().unwrap()[0]));
    drain(&h, &recorder, &options).await;
    assert_eq!(recorder.refused.load(Ordering::SeqCst), 3);
    // Parked after its third refusal; the next message of its key went on.
    let parked = h.inbox().parked_messages(None, 10).await.unwrap();
    assert_eq!(parked.len(), 1);
    let record = &parked[0];
    assert_eq!(record.message_id, poison.ids.lock().unwrap()[0]);
    assert_eq!((record.state, record.attempts), (OutboxState::Parked, 3));
    assert!(
        record
            .last_error
            .as_deref()
            .unwrap()
            .contains("no queue is bound"),
        "{record:?}"
    );
    assert!(published(&recorder).contains(&after.ids.lock().unwrap()[0]));
    let stats = h.inbox().outbox_stats().await.unwrap();
    assert_eq!((stats.pending, stats.sent, stats.parked), (0, 6, 1));

    // Fixed (a queue is bound now): retried by hand, it goes out.
    closed.store(false, Ordering::SeqCst);
    assert!(h.inbox().retry_parked(record.row).await.unwrap());
    assert!(
        !h.inbox().retry_parked(record.row).await.unwrap(),
        "retried twice"
    );
    drain(&h, &recorder, &options).await;
    assert!(published(&recorder).contains(&record.message_id));
    let record = h.inbox().outbox_message(record.row).await.unwrap().unwrap();
    assert_eq!(record.state, OutboxState::Sent);
    assert!(record.sent_at.is_some());
    assert!(
        h.inbox()
            .parked_messages(None, 10)
            .await
            .unwrap()
            .is_empty()
    );
}

/// A broker that is down: it confirms nothing, or (`hangs`) never answers.
struct Down {
    hangs: bool,
}

impl Publisher for Down {
    async fn publish(&self, _: &Publication) -> Result<(), PublishError> {
        if self.hangs {
            std::future::pending::<()>().await;
        }
        Err(PublishError::unavailable("connection refused"))
    }
}

pub async fn unconfirmed_messages_stay_pending_without_counting_an_attempt(h: impl Harness) {
    for label in ["down-1", "down-2"] {
        let msg = Delivery::new(label).sending(Outgoing {
            ordering_key: (label == "down-2").then(|| "k".to_owned()),
            ..Outgoing::default()
        });
        assert!(h.deliver_notifier(&msg).await.unwrap().is_processed());
    }
    let options = options()
        .attempts(1, Duration::from_secs(60))
        .publish_timeout(Duration::from_millis(100));
    for hangs in [false, true] {
        let report = h
            .inbox()
            .relay_once(&Down { hangs }, &options)
            .await
            .unwrap();
        assert_eq!((report.taken, report.unavailable, report.parked), (2, 2, 0));
        let stats = h.inbox().outbox_stats().await.unwrap();
        assert_eq!(
            (stats.pending, stats.sent, stats.parked),
            (2, 0, 0),
            "hangs: {hangs}"
        );
    }
    for (id, ..) in h.outbox_rows().await {
        let record = &h.inbox().outbox_messages(&id).await.unwrap()[0];
        assert_eq!((record.state, record.attempts), (OutboxState::Pending, 0));
        assert_eq!(record.sent_at, None);
    }
    let recorder = Recorder::new(Duration::ZERO);
    drain(&h, &recorder, &options).await;
    assert_eq!(recorder.published.lock().unwrap().len(), 2);
    let publication = &recorder.published.lock().unwrap()[0];
    assert_eq!(
        publication.attempt, 1,
        "a broker that was down is no attempt"
    );
}

pub async fn sent_outgoing_rows_are_purged_after_the_outbox_retention(h: impl Harness) {
    for label in ["sent-1", "sent-2"] {
        let outgoing = Outgoing {
            ordering_key: Some(format!("key-{label}")),
            ..Outgoing::default()
        };
        let msg = Delivery::new(label).sending(outgoing);
        assert!(h.deliver_notifier(&msg).await.unwrap().is_processed());
    }
    let recorder = Recorder::new(Duration::ZERO);
    drain(&h, &recorder, &options()).await;
    // One message parked at its first refusal, then one left pending (no relay runs after it).
    let parked = Outgoing {
        destination: "parked".into(),
        ..Outgoing::default()
    };
    let msg = Delivery::new("parked").sending(parked);
    assert!(h.deliver_notifier(&msg).await.unwrap().is_processed());
    let refusing = Recorder::refusing(Duration::ZERO, |_| true);
    let park_at_once = options().attempts(1, Duration::from_secs(60));
    h.inbox()
        .relay_once(&refusing, &park_at_once)
        .await
        .unwrap();
    let pending = Outgoing {
        destination: "pending".into(),
        ..Outgoing::default()
    };
    let msg = Delivery::new("pending").sending(pending);
    assert!(h.deliver_notifier(&msg).await.unwrap().is_processed());
    tokio::time::sleep(Duration::from_millis(20)).await;

    let keep = h
        .inbox()
        .clone()
        .with_outbox_retention(Duration::from_secs(3600));
    assert_eq!(keep.purge_expired(10).await.unwrap().outbox_deleted, 0);
    assert_eq!(h.outbox_rows().await.len(), 4);
    let purge = h.inbox().clone().with_outbox_retention(Duration::ZERO);
    let report = purge.purge_expired(1).await.unwrap();
    assert_eq!(report.outbox_deleted, 2);
    let remaining: Vec<(String, i64)> = h
        .outbox_rows()
        .await
        .into_iter()
        .map(|row| (row.1, row.4))
        .collect();
    assert_eq!(
        remaining,
        [("parked".to_owned(), 2), ("pending".to_owned(), 0)],
        "the purge deleted a row that was not sent, or kept a sent one"
    );
    // The ordering keys whose rows were all sent are gone too: a new message of one starts again.
    let msg = Delivery::new("sent-3").sending(Outgoing {
        ordering_key: Some("key-sent-1".into()),
        ..Outgoing::default()
    });
    assert!(h.deliver_notifier(&msg).await.unwrap().is_processed());
    let rows = h.outbox_rows().await;
    let new = rows
        .iter()
        .find(|row| row.2.as_deref() == Some("key-sent-1"))
        .unwrap();
    assert_eq!(new.3, Some(1));
}

pub async fn migrate_upgrades_version_2_tables_to_the_outbox(h: impl Harness) {
    use idempotent::schema::CURRENT_VERSION;
    assert!(
        h.deliver_notifier(&Delivery::new("before"))
            .await
            .unwrap()
            .is_processed()
    );
    // The tables as version 2 left them: no outbox, no record of a later version.
    for sql in [
        "DROP TABLE idempotent_inbox_outbox",
        "DROP TABLE idempotent_inbox_outbox_keys",
        "UPDATE idempotent_inbox_schema SET version = 2",
    ] {
        h.execute(sql).await;
    }
    let migrated = h.inbox().migrate().await.unwrap();
    assert_eq!((migrated.from, migrated.to), (2, CURRENT_VERSION));
    assert!(h.inbox().is_processed("notifier", "before").await.unwrap());
    assert!(
        h.deliver_notifier(&Delivery::new("before"))
            .await
            .unwrap()
            .is_duplicate()
    );
    let msg = Delivery::new("after").sending(Outgoing {
        ordering_key: Some("k".into()),
        ..Outgoing::default()
    });
    assert!(h.deliver_notifier(&msg).await.unwrap().is_processed());
    assert_eq!(h.outbox_rows().await.len(), 1);
    let again = h.inbox().migrate().await.unwrap();
    assert_eq!((again.from, again.to), (CURRENT_VERSION, CURRENT_VERSION));
}

/// What a relay handed the broker, per message: its id, payload, headers and attempt.
type Seen = (String, Vec<u8>, Vec<(String, String)>, u32);
