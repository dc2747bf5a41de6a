//! Only one instance purges a table at a time: while another session holds the purger's lock
//! (PostgreSQL advisory lock on the table's OID, MySQL `GET_LOCK` named after database and table),
//! a purge does nothing and says so. A purge dropped half-way (a timeout around it, a stopped
//! purger) releases the lock: the next purge, in any instance, goes ahead.
#![cfg(all(feature = "postgres", feature = "mysql"))]

#[path = "../support/mod.rs"]
mod support;

use std::time::Duration;

use idempotent::{Inbox, PurgerOptions};
use support::Harness;
use support::mysql::MySqlHarness;
use support::postgres::PgHarness;

const DAY: Duration = Duration::from_secs(24 * 60 * 60);

/// The lock the PostgreSQL purger takes, as its module docs describe it.
const PG_LOCK: &str = "1768453, coalesce(to_regclass('\"idempotent_inbox\"')::oid::int, 0)";

/// The lock the MySQL purger takes, as its module docs describe it.
const MYSQL_LOCK: &str =
    "CONCAT('idempotent_purge_', LEFT(SHA1(CONCAT(DATABASE(), '.', 'idempotent_inbox')), 40))";

#[tokio::test]
async fn postgres_purge_skips_while_another_instance_purges() {
    let h = PgHarness::new().await;
    h.bulk_rows("old", 10).await;
    h.backdate("old", 30 * DAY).await;
    let mut other = h.pool.acquire().await.unwrap();
    let lock = |verb: &str| format!("SELECT pg_advisory_{verb}({PG_LOCK})");
    sqlx::query(sqlx::AssertSqlSafe(lock("lock")))
        .execute(&mut *other)
        .await
        .unwrap();
    let report = h.inbox.purge_expired(100).await.unwrap();
    assert!(report.locked_elsewhere);
    assert_eq!(report.deleted, 0);
    assert_eq!(h.inbox_rows().await, 10);

    sqlx::query(sqlx::AssertSqlSafe(lock("unlock")))
        .execute(&mut *other)
        .await
        .unwrap();
    let report = h.inbox.purge_expired(100).await.unwrap();
    assert!(!report.locked_elsewhere);
    assert_eq!(report.deleted, 10);
}

#[tokio::test]
async fn mysql_purge_skips_while_another_instance_purges() {
    let h = MySqlHarness::new().await;
    h.bulk_rows("old", 10).await;
    h.backdate("old", 30 * DAY).await;
    let mut other = h.pool.acquire().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT GET_LOCK({MYSQL_LOCK}, 0)"
    )))
    .execute(&mut *other)
    .await
    .unwrap();
    let report = h.inbox.purge_expired(100).await.unwrap();
    assert!(report.locked_elsewhere);
    assert_eq!(h.inbox_rows().await, 10);

    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT RELEASE_LOCK({MYSQL_LOCK})"
    )))
    .execute(&mut *other)
    .await
    .unwrap();
    assert_eq!(h.inbox.purge_expired(100).await.unwrap().deleted, 10);
}

/// Rows enough for a purge in batches of one to take a while.
const BACKLOG: usize = 3000;

/// Whether the lock is free within 20 s: a dropped purge closes its session, and the server ends
/// the session (and frees its lock) a moment later, longer on a busy machine.
async fn freed(lock_is_free: &impl AsyncFn() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if lock_is_free().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Drops a purge half-way twice (a timeout, then a stopped purger), and checks each time that
/// another instance's purge is not locked out and that no session holds the lock.
async fn dropped_purges_release_the_lock<H: Harness>(
    h: &H,
    other_instance: Inbox<H::Db>,
    lock_is_free: impl AsyncFn() -> bool,
) {
    h.bulk_rows("old", BACKLOG).await;
    h.backdate("old", 30 * DAY).await;

    let purge = h.inbox().purge_expired(1);
    let cut = tokio::time::timeout(Duration::from_millis(300), purge).await;
    assert!(
        cut.is_err(),
        "the purge finished before it could be dropped"
    );
    let left = h.inbox_rows().await;
    assert!(0 < left && left < BACKLOG as i64, "{left} rows left");
    assert!(
        freed(&lock_is_free).await,
        "the dropped purge kept its lock"
    );

    let purger = h
        .inbox()
        .spawn_purger(PurgerOptions::every(Duration::from_secs(3600)).batch_size(1));
    tokio::time::sleep(Duration::from_millis(300)).await;
    purger.stop();
    tokio::time::sleep(Duration::from_millis(100)).await; // the task ends at its next await
    assert!(
        freed(&lock_is_free).await,
        "the stopped purger kept its lock"
    );

    let report = other_instance.purge_expired(1000).await.unwrap();
    assert!(!report.locked_elsewhere, "{report:?}");
    assert_eq!(h.inbox_rows().await, 0);
}

#[tokio::test]
async fn postgres_purge_dropped_half_way_releases_its_lock() {
    let h = PgHarness::new().await;
    let other = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(h.pool.connect_options().as_ref().clone())
        .await
        .unwrap();
    let lock_is_free = async || {
        // Taking the lock in another session succeeds only if nobody holds it.
        let mut conn = other.acquire().await.unwrap();
        let free: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT pg_try_advisory_lock({PG_LOCK})"
        )))
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        if free {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "SELECT pg_advisory_unlock({PG_LOCK})"
            )))
            .execute(&mut *conn)
            .await
            .unwrap();
        }
        free
    };
    dropped_purges_release_the_lock(&h, Inbox::new(other.clone()), lock_is_free).await;
}

#[tokio::test]
async fn mysql_purge_dropped_half_way_releases_its_lock() {
    let h = MySqlHarness::new().await;
    let other = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(2)
        .connect_with(h.pool.connect_options().as_ref().clone())
        .await
        .unwrap();
    let lock_is_free = async || {
        let free: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT IS_FREE_LOCK({MYSQL_LOCK})"
        )))
        .fetch_one(&other)
        .await
        .unwrap();
        free == Some(1)
    };
    dropped_purges_release_the_lock(&h, Inbox::new(other.clone()), lock_is_free).await;
}
