//! Hostile tests of the relays' wake-up after a handler's commit (PostgreSQL's `NOTIFY` sent
//! after the commit by one task per inbox and channel): relays that poll once an hour must still
//! get every message promptly.

#[path = "schema.rs"]
mod schema;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotent::Inbox;
use idempotent::outbox::{
    Destination, OutgoingMessage, Publication, PublishError, Publisher, RelayOptions,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Postgres};

#[derive(Default)]
struct Recorder {
    published: Mutex<Vec<String>>,
}

impl Publisher for Recorder {
    async fn publish(&self, publication: &Publication) -> Result<(), PublishError> {
        self.published
            .lock()
            .unwrap()
            .push(publication.message_id.clone());
        Ok(())
    }
}

impl Recorder {
    fn count(&self) -> usize {
        self.published.lock().unwrap().len()
    }
}

const HOUR: Duration = Duration::from_secs(3600);

fn hourly() -> RelayOptions {
    RelayOptions::default().poll_interval(HOUR, HOUR)
}

async fn schema() -> PgConnectOptions {
    schema::fresh_schema().await
}

async fn pool(options: &PgConnectOptions, connections: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(connections)
        .min_connections(connections)
        .connect_with(options.clone())
        .await
        .unwrap()
}

/// Claims `key` and commits one outgoing message with it.
async fn commit_one(inbox: &Inbox<Postgres>, key: &str) {
    let mut claimed = inbox.claim("adv", key).await.unwrap().expect("a new key");
    claimed
        .outbox()
        .send(OutgoingMessage::new(Destination::queue("q"), b"x".to_vec()));
    claimed.commit().await.unwrap();
}

/// Waits up to `within` for `recorder` to have `count` publications.
async fn until_published(recorder: &Recorder, count: usize, within: Duration) -> bool {
    let start = Instant::now();
    while recorder.count() < count {
        if start.elapsed() > within {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// A commit on a runtime that ends right after it (a `#[tokio::test]` that returns, a
/// `block_on` per request, a worker runtime shut down) cuts off the task that was to send its
/// `NOTIFY`. Its message is left to the poll (documented), but later commits on the inbox (a
/// clone, on the runtime that lives on) must still wake the relay.
#[test]
fn a_commit_on_a_runtime_that_ends_at_once_does_not_silence_later_wake_ups() {
    commit_on_a_short_runtime_then_later_commits(Duration::ZERO);
}

/// The control: the same, with the short runtime living 300 ms after its commit (its `NOTIFY`
/// task gets to run): passes.
#[test]
fn control_a_commit_on_a_runtime_that_lingers_then_later_commits_wake_the_relay() {
    commit_on_a_short_runtime_then_later_commits(Duration::from_millis(300));
}

fn commit_on_a_short_runtime_then_later_commits(linger: Duration) {
    let main = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (inbox, recorder, relay) = main.block_on(async {
        let options = schema().await;
        // Connections made on `main` (whose reactor lives on) and kept: the short runtime below
        // uses one of them, not one of its own.
        let inbox = Inbox::new(pool(&options, 3).await);
        inbox.migrate().await.unwrap();
        let recorder = Arc::new(Recorder::default());
        let relay = inbox.spawn_relay(recorder.clone(), hourly());
        tokio::time::sleep(Duration::from_millis(300)).await; // listening
        commit_one(&inbox, "before").await;
        assert!(
            until_published(&recorder, 1, Duration::from_secs(30)).await,
            "the relay is not woken at all"
        );
        (inbox, recorder, relay)
    });
    // A short-lived runtime commits with a clone of the inbox, then ends.
    {
        let short = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let inbox = inbox.clone();
        short.block_on(async move {
            commit_one(&inbox, "on-a-runtime-that-ends").await;
            // (Not even a `sleep(ZERO)`: that lets the NOTIFY task start, and its drop then
            // resets the channel's state.)
            if !linger.is_zero() {
                tokio::time::sleep(linger).await;
            }
        });
        drop(short);
    }
    main.block_on(async {
        for i in 0..3 {
            commit_one(&inbox, &format!("after-{i}")).await;
        }
        let woken = until_published(&recorder, 5, Duration::from_secs(30)).await;
        let published = recorder.count();
        relay.shutdown().await;
        assert!(
            woken,
            "later commits did not wake the relay: {published} of 5 published within 30 s (it \
             polls once an hour)"
        );
    });
}

/// Several inboxes on one database, each with its own table (`with_table`, clones sharing the
/// wake-up state), a commit storm on each: every relay gets all its messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_storms_on_many_tables_wake_every_relay() {
    let options = schema().await;
    let base = Inbox::new(pool(&options, 12).await);
    let mut inboxes = Vec::new();
    for t in 0..4 {
        let inbox = base.clone().with_table(&format!("inbox_{t}")).unwrap();
        inbox.migrate().await.unwrap();
        let recorder = Arc::new(Recorder::default());
        let relay = inbox.spawn_relay(recorder.clone(), hourly());
        inboxes.push((inbox, recorder, relay));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let work = inboxes.iter().flat_map(|(inbox, _, _)| {
        (0..4).map(move |w| async move {
            for i in 0..25 {
                commit_one(inbox, &format!("w{w}-{i}")).await;
            }
        })
    });
    futures::future::join_all(work).await;
    for (t, (_, recorder, _)) in inboxes.iter().enumerate() {
        assert!(
            until_published(recorder, 100, Duration::from_secs(30)).await,
            "table {t}: {} of 100",
            recorder.count()
        );
    }
}

/// A pool of 1 (then 2) connections and 8 handlers committing in a loop: the wake-up competes
/// with the handlers for the connection, yet every message reaches the relay (on a pool of its
/// own) soon.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_pool_still_wakes_the_relay() {
    let options = schema().await;
    for connections in [1, 2] {
        let table = format!("pool_{connections}");
        let inbox = Inbox::new(pool(&options, connections).await)
            .with_table(&table)
            .unwrap();
        inbox.migrate().await.unwrap();
        // The relay on a pool of its own (its listener holds one of its pool's connections).
        let relay_inbox = Inbox::new(pool(&options, 3).await)
            .with_table(&table)
            .unwrap();
        let recorder = Arc::new(Recorder::default());
        let relay = relay_inbox.spawn_relay(recorder.clone(), hourly());
        tokio::time::sleep(Duration::from_millis(300)).await;
        let started = Instant::now();
        let work = (0..8).map(|w| {
            let inbox = &inbox;
            async move {
                for i in 0..20 {
                    commit_one(inbox, &format!("w{w}-{i}")).await;
                }
            }
        });
        futures::future::join_all(work).await;
        let ok = until_published(&recorder, 160, Duration::from_secs(30)).await;
        eprintln!(
            "pool of {connections}: {} in {:?}",
            recorder.count(),
            started.elapsed()
        );
        relay.shutdown().await;
        assert!(ok, "pool of {connections}: {} of 160", recorder.count());
    }
}

/// `with_outbox_notify(false)` on a clone of an inbox that notifies: the notifying clone still
/// wakes the relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_clone_does_not_silence_the_notifying_inbox() {
    let options = schema().await;
    let inbox = Inbox::new(pool(&options, 4).await);
    inbox.migrate().await.unwrap();
    let quiet = inbox.clone().with_outbox_notify(false);
    let recorder = Arc::new(Recorder::default());
    let relay = inbox.spawn_relay(recorder.clone(), hourly());
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 0..5 {
        commit_one(&quiet, &format!("quiet-{i}")).await;
    }
    commit_one(&inbox, "loud").await;
    let ok = until_published(&recorder, 6, Duration::from_secs(30)).await;
    let count = recorder.count();
    relay.shutdown().await;
    assert!(ok, "{count} of 6");
}
