//! The inbox behind PgBouncer 1.18 in transaction mode (`IDEMPOTENT_PGBOUNCER_URL`, which
//! `scripts/pgbouncer start` sets): the conformance suite through it, what sqlx's statements do
//! there, the start-up check that refuses an inbox not told about the pooler, the pipelined claim's
//! fallback, and the purger's lock.
//!
//! PgBouncer in transaction mode hands each transaction whichever server session is free, and
//! 1.18 keeps no prepared statements for its clients. What that does to sqlx 0.9, as these tests
//! show: a statement sqlx prepares is named `sqlx_s_<n>` on every connection alike and, with a
//! statement cache, reused in later transactions, on other sessions (SQLSTATE 26000 "does not
//! exist", 42P05 "already exists"); without a cache (`statement_cache_capacity(0)`) it is still
//! named, and left behind on the session; and outside a transaction its parse and its execution
//! are two requests that PgBouncer may send to two sessions. What works: statements inside a
//! transaction, from a pool without a statement cache, with PgBouncer resetting every session
//! after each transaction (`server_reset_query_always = 1`), or statements sent unprepared
//! (`.persistent(false)`) inside a transaction with any settings.
#![cfg(feature = "postgres")]

#[path = "../conformance/mod.rs"]
mod conformance;
#[path = "../support/mod.rs"]
mod support;

use std::time::Duration;

use idempotent::{Handled, Inbox, InboxError};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use support::postgres::{PgHarness, pgbouncer_urls};
use support::{Consumer, Delivery, Harness};

use conformance::conformance_tests;

conformance_tests!(@pooled PgHarness::through_pgbouncer().await);

/// The one conformance case that does not hold through a pooler in transaction mode, run to show
/// how: a worker's inbox keeps its *client* connection between messages (which saves sqlx's pool
/// checks), but PgBouncer gives each transaction whichever server session is free, so what a
/// session keeps (here a temporary table) is not there in the next transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "the worker's inbox did not keep its connection")]
async fn worker_inbox_keeps_its_client_connection_but_not_a_server_session() {
    conformance::worker_inbox_keeps_its_connection_between_messages(
        PgHarness::through_pgbouncer().await,
    )
    .await;
}

/// A pool through PgBouncer, to the test's database.
fn bouncer_pool(h: &PgHarness, connections: u32, cache: Option<usize>) -> sqlx::PgPool {
    let (bouncer, _) = pgbouncer_urls();
    let mut options: PgConnectOptions = bouncer.parse().unwrap();
    options = options.database(&h.schema);
    if let Some(capacity) = cache {
        options = options.statement_cache_capacity(capacity);
    }
    PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(options)
}

/// SQLSTATEs of the failures of `runs` concurrent runs of `statement` on `pool`; `in_transaction`
/// runs each inside a transaction. Every success must return the right value: a statement run on
/// a session where another client's statement of the same name lives would not.
async fn sqlstates(
    pool: &sqlx::PgPool,
    persistent: bool,
    in_transaction: bool,
) -> std::collections::BTreeMap<String, usize> {
    let runs = futures::future::join_all((0..8i64).map(|worker| async move {
        let mut failures = Vec::new();
        for i in 0..50i64 {
            let run = async {
                let query = sqlx::query_scalar::<_, i64>("SELECT $1::int8 * 1000 + $2::int8")
                    .bind(worker)
                    .bind(i)
                    .persistent(persistent);
                if in_transaction {
                    let mut tx = pool.begin().await?;
                    let value = query.fetch_one(&mut *tx).await?;
                    tx.commit().await?;
                    Ok(value)
                } else {
                    query.fetch_one(pool).await
                }
            };
            match run.await {
                Ok(value) => assert_eq!(value, worker * 1000 + i),
                Err(error) => failures.push(error),
            }
        }
        failures
    }))
    .await;
    let mut states = std::collections::BTreeMap::new();
    for error in runs.into_iter().flatten() {
        assert!(
            idempotent::is_retryable(&error),
            "a lost or clashing statement must be retryable: {error:?}"
        );
        let state = error
            .as_database_error()
            .and_then(|e| e.code())
            .map_or_else(|| format!("{error}"), |c| c.into_owned());
        *states.entry(state).or_insert(0) += 1;
    }
    states
}

/// Whether the PgBouncer in front resets every server session after each transaction
/// (`server_reset_query_always`), as its admin console says.
async fn resets_always() -> bool {
    use sqlx::{Connection, Row};
    let (bouncer, _) = pgbouncer_urls();
    let options: PgConnectOptions = bouncer.parse().unwrap();
    let mut admin = sqlx::PgConnection::connect_with(&options.database("pgbouncer"))
        .await
        .expect("PgBouncer's admin console");
    let rows = sqlx::raw_sql("SHOW CONFIG")
        .fetch_all(&mut admin)
        .await
        .unwrap();
    rows.iter()
        .find(|row| row.get::<String, _>(0) == "server_reset_query_always")
        .map(|row| row.get::<String, _>(1) == "1")
        .expect("server_reset_query_always in SHOW CONFIG")
}

/// What sqlx's statements do through PgBouncer 1.18 in transaction mode. With a statement cache,
/// a statement prepared in one transaction is missing in the next (26000) or clashes with another
/// client's of the same name (42P05). Without a cache (`statement_cache_capacity(0)`) statements
/// are still named, and left on the session: inside a transaction they work only when PgBouncer
/// resets every session after each transaction (`server_reset_query_always = 1`, as
/// `scripts/pgbouncer` sets it); unprepared ones (`.persistent(false)`) work inside a transaction
/// either way. Outside a transaction, with the reset, every statement with parameters fails,
/// cleanly (26000): its parse and its execution reach two sessions. Every failure is retryable
/// and closes the connection. (`IDEMPOTENT_PGBOUNCER_RESET_ALWAYS=0 scripts/pgbouncer start`
/// starts PgBouncer without the reset, for the other half of the README's table.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_statements_through_pgbouncer_in_transaction_mode() {
    let reset = resets_always().await;
    let h = PgHarness::through_pgbouncer().await;
    let cached = bouncer_pool(&h, 8, None);
    let in_tx = sqlstates(&cached, true, true).await;
    assert!(!in_tx.is_empty(), "{in_tx:?}");
    let outside = sqlstates(&cached, true, false).await;
    assert!(!outside.is_empty(), "{outside:?}");

    let uncached = bouncer_pool(&h, 8, Some(0));
    let named_in_tx = sqlstates(&uncached, true, true).await;
    let unprepared_in_tx = sqlstates(&uncached, false, true).await;
    assert!(unprepared_in_tx.is_empty(), "{unprepared_in_tx:?}");
    if reset {
        assert!(named_in_tx.is_empty(), "{named_in_tx:?}");
        for persistent in [true, false] {
            let outside = sqlstates(&uncached, persistent, false).await;
            assert_eq!(
                outside.keys().collect::<Vec<_>>(),
                ["26000"],
                "persistent {persistent}: {outside:?}"
            );
            assert_eq!(
                outside["26000"], 400,
                "persistent {persistent}: {outside:?}"
            );
        }
    } else {
        assert!(named_in_tx.contains_key("42P05"), "{named_in_tx:?}");
        let named_outside = sqlstates(&uncached, true, false).await;
        assert!(!named_outside.is_empty(), "{named_outside:?}");
        // Unprepared, outside a transaction: it usually works, as the other sessions seldom have
        // an unnamed statement; when the execution reaches another session it fails (26000).
        let unprepared_outside = sqlstates(&uncached, false, false).await;
        assert!(
            unprepared_outside.keys().all(|state| state == "26000"),
            "{unprepared_outside:?}"
        );
    }
}

/// An inbox whose pool goes through PgBouncer in transaction mode, but which was not told so,
/// refuses to start: `migrate()` finds the pooler and says what to do, instead of letting claims
/// fail message by message. Told (`with_transaction_pooling()`), it migrates; on a direct
/// connection the check finds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inbox_not_told_about_the_pooler_refuses_to_start() {
    let h = PgHarness::through_pgbouncer().await;
    for cache in [None, Some(0)] {
        let inbox = Inbox::new(bouncer_pool(&h, 4, cache));
        let error = inbox.migrate().await.unwrap_err();
        assert!(matches!(error, InboxError::TransactionPooling), "{error:?}");
        assert!(!error.is_retryable());
        assert!(
            error.to_string().contains("with_transaction_pooling()"),
            "{error}"
        );
        inbox.with_transaction_pooling().migrate().await.unwrap();
    }
    Inbox::new(h.pool.clone()).migrate().await.unwrap();
}

/// The pipelined claim's statement is prepared by each session with `PREPARE`; behind the pooler
/// the next transaction runs on a session reset since, so the claim falls back to the quiet claim
/// message by message (after two errors, which the server logs). Told about the pooler, the inbox
/// sends the quiet claim straight away. Either way each message has its effect once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pipelined_claim_falls_back_to_the_quiet_claim_per_message() {
    let h = PgHarness::through_pgbouncer().await;
    let fallback = Inbox::new(bouncer_pool(&h, 4, Some(0))).with_pipelined_claim();
    let told = fallback.clone().with_transaction_pooling();
    for (inbox, prefix) in [(&fallback, "fallback"), (&told, "told")] {
        for i in 0..20 {
            let msg = Delivery::new(&format!("{prefix}-{i}"));
            let first = h.deliver_on(inbox, Consumer::Orders, &msg).await.unwrap();
            assert!(first.is_processed(), "{first:?}");
            let again = h.deliver_on(inbox, Consumer::Orders, &msg).await.unwrap();
            assert!(again.is_duplicate(), "{again:?}");
        }
    }
    let counts = h.effect_counts("orders").await;
    assert_eq!(counts.len(), 40);
    assert!(counts.values().all(|&n| n == 1), "{counts:?}");
}

/// What a session's advisory lock (the purger's lock on a direct connection) does through the
/// pooler: the server session it was taken on is reset after the statement's transaction, which
/// releases it at once. So behind the pooler the purger takes a transaction's lock instead and
/// keeps that transaction open while it purges: another instance is locked out for the purge's
/// length, the lock is gone when it ends, and a purge dropped half-way (its client connection
/// closed, so PgBouncer closes the server session it had) leaves no lock behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_purgers_lock_holds_through_the_pooler() {
    const DAY: Duration = Duration::from_secs(24 * 60 * 60);
    const LOCK: &str = "1768453, coalesce(to_regclass('\"idempotent_inbox\"')::oid::int, 0)";
    let h = PgHarness::through_pgbouncer().await;
    let direct_lock_is_free = async || {
        let mut conn = h.pool.acquire().await.unwrap();
        let free: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT pg_try_advisory_lock({LOCK})"
        )))
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        if free {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "SELECT pg_advisory_unlock({LOCK})"
            )))
            .execute(&mut *conn)
            .await
            .unwrap();
        }
        free
    };
    // The lock is freed by PgBouncer's reset or by the server session's end: a moment after the
    // client's transaction or connection ended.
    let lock_freed_within_5_s = async || {
        for _ in 0..50 {
            if direct_lock_is_free().await {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    };

    // A session's lock, taken through the pooler: gone once the statement's transaction ended
    // and PgBouncer reset its session.
    let through = bouncer_pool(&h, 2, Some(0));
    let mut conn = through.acquire().await.unwrap();
    let taken: bool = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SELECT pg_try_advisory_lock({LOCK})"
    )))
    .fetch_one(&mut *conn)
    .await
    .map(|row| sqlx::Row::get(&row, 0))
    .unwrap();
    assert!(taken);
    let free = lock_freed_within_5_s().await;
    assert!(
        free,
        "a session's lock survived its transaction behind the pooler"
    );
    drop(conn);

    // The purger's lock: another instance's purge skips while a purge runs, for its whole length.
    h.bulk_rows("old", 2000).await;
    h.backdate("old", 30 * DAY).await;
    let other = Inbox::new(bouncer_pool(&h, 2, Some(0))).with_transaction_pooling();
    let slow = h.inbox.purge_expired(1);
    let watcher = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut skipped = 0;
        for _ in 0..3 {
            assert!(
                !direct_lock_is_free().await,
                "the purger's lock is not held"
            );
            let report = other.purge_expired(100).await.unwrap();
            assert!(report.locked_elsewhere, "{report:?}");
            skipped += 1;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        skipped
    };
    let cut = tokio::time::timeout(Duration::from_secs(60), async {
        tokio::join!(slow, watcher)
    })
    .await
    .expect("the slow purge hung");
    let (report, skipped) = cut;
    assert_eq!(report.unwrap().deleted, 2000);
    assert_eq!(skipped, 3);
    assert!(direct_lock_is_free().await, "the purge kept its lock");

    // Dropped half-way: PgBouncer closes the server session of a client gone mid-transaction.
    h.bulk_rows("older", 3000).await;
    h.backdate("older", 30 * DAY).await;
    let cut = tokio::time::timeout(Duration::from_millis(300), h.inbox.purge_expired(1)).await;
    assert!(
        cut.is_err(),
        "the purge finished before it could be dropped"
    );
    let free = lock_freed_within_5_s().await;
    assert!(free, "the dropped purge left its lock behind");
    let report = other.purge_expired(1000).await.unwrap();
    assert!(!report.locked_elsewhere, "{report:?}");
    assert_eq!(h.inbox_rows().await, 0);
}

/// A worker's inbox through the pooler: messages one after another on one kept client
/// connection, a failing body, a duplicate's stored response, all as on a direct connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_behind_the_pooler_handles_messages_one_after_another() {
    let h = PgHarness::through_pgbouncer().await;
    let worker = h.inbox.for_worker();
    for i in 0..30 {
        let msg = Delivery::new(&format!("w-{i}"));
        assert!(
            h.deliver_on(&worker, Consumer::Orders, &msg)
                .await
                .unwrap()
                .is_processed()
        );
        let quote = h.deliver_quote_on(&worker, &msg).await.unwrap();
        assert_eq!(quote, Handled::Processed(format!("quote for w-{i}")));
        let again = h.deliver_quote_on(&worker, &msg).await.unwrap();
        assert_eq!(again.value(), Some(format!("quote for w-{i}")));
    }
    assert_eq!(h.effect_counts("orders").await.len(), 30);
    assert_eq!(h.effect_counts("quotes").await.len(), 30);
}
