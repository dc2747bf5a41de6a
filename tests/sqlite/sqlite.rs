//! The conformance suite on SQLite: a fresh database file per test, and the in-memory inbox for
//! users' unit tests.
#![cfg(feature = "sqlite")]

#[path = "../conformance/mod.rs"]
mod conformance;
#[path = "../support/mod.rs"]
mod support;

use conformance::conformance_tests;
use support::sqlite::SqliteHarness;

conformance_tests!(SqliteHarness::new().await);

mod in_memory {
    use crate::conformance::conformance_tests;
    use crate::support::sqlite::SqliteHarness;

    conformance_tests!(SqliteHarness::in_memory().await);
}

/// An inbox queues its own writers for SQLite's one write lock. A claim made while a transaction of
/// the same inbox is open (a handler calling another handler on the same inbox) waits in that queue
/// for a while, then meets the database's lock and fails with a retryable busy error, rather than
/// wait for ever; once the first transaction ends, the claim goes ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_nested_in_a_transaction_of_the_same_inbox_fails_retryably() {
    use idempotent::message_key;

    let h = SqliteHarness::new().await;
    let inbox = &h.impatient; // its connections give up on the lock after 300 ms
    let outer = message_key("outer").unwrap();
    let inner = message_key("inner").unwrap();
    let held = inbox.claim("orders", &outer).await.unwrap().unwrap();
    let nested = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        inbox.claim("orders", &inner),
    )
    .await
    .expect("the nested claim waited for ever");
    let error = nested.unwrap_err();
    assert!(error.is_retryable(), "{error:?}");
    held.commit().await.unwrap();
    let claimed = inbox.claim("orders", &inner).await.unwrap();
    claimed
        .expect("the key was never claimed")
        .commit()
        .await
        .unwrap();
    assert!(inbox.is_processed("orders", "inner").await.unwrap());
}

/// Four workers on a pool of two connections: the workers that keep a connection give it back to
/// the pool while another waits for one, and a worker takes its turn in the writers' queue only
/// once it has its connection, so they take turns instead of stalling until the pool's timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_workers_than_connections_take_turns_instead_of_stalling() {
    use support::{Consumer, Delivery, Harness};

    let h = SqliteHarness::new().await;
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(2)
        .acquire_timeout(std::time::Duration::from_secs(60))
        .connect_with(h.pool.connect_options().as_ref().clone())
        .await
        .unwrap();
    let inbox = idempotent::Inbox::new(pool);
    let workers = (0..4).map(|worker| {
        let inbox = inbox.for_worker();
        let h = &h;
        async move {
            for message in 0..6 {
                let msg = Delivery::new(&format!("w{worker}-{message}"));
                let outcome = h.deliver_on(&inbox, Consumer::Orders, &msg).await;
                assert!(outcome.unwrap().is_processed());
            }
        }
    });
    tokio::time::timeout(
        std::time::Duration::from_secs(20),
        futures::future::join_all(workers),
    )
    .await
    .expect("the workers stalled waiting for connections kept by the others");
    assert_eq!(h.effect_counts("orders").await.len(), 24);
    assert_eq!(h.inbox_rows().await, 24);
}
