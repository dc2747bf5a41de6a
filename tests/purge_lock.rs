//! Only one instance purges a table at a time: while another session holds the purger's lock
//! (PostgreSQL advisory lock, MySQL `GET_LOCK`), a purge does nothing and says so.
#![cfg(all(feature = "postgres", feature = "mysql"))]

mod support;

use std::time::Duration;

use support::Harness;
use support::mysql::MySqlHarness;
use support::postgres::PgHarness;

const DAY: Duration = Duration::from_secs(24 * 60 * 60);

#[tokio::test]
async fn postgres_purge_skips_while_another_instance_purges() {
    let h = PgHarness::new().await;
    h.bulk_rows("old", 10).await;
    h.backdate("old", 30 * DAY).await;
    let mut other = h.pool.acquire().await.unwrap();
    let key = idempotent::postgres::PURGE_LOCK_KEY;
    let table = "\"idempotent_inbox\"";
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT pg_advisory_lock({key})"
    )))
    .bind(table)
    .execute(&mut *other)
    .await
    .unwrap();
    let report = h.inbox.purge_expired(100).await.unwrap();
    assert!(report.locked_elsewhere);
    assert_eq!(report.deleted, 0);
    assert_eq!(h.inbox_rows().await, 10);

    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT pg_advisory_unlock({key})"
    )))
    .bind(table)
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
    let name = idempotent::mysql::PURGE_LOCK_NAME;
    sqlx::query(sqlx::AssertSqlSafe(format!("SELECT GET_LOCK({name}, 0)")))
        .bind("idempotent_inbox")
        .execute(&mut *other)
        .await
        .unwrap();
    let report = h.inbox.purge_expired(100).await.unwrap();
    assert!(report.locked_elsewhere);
    assert_eq!(h.inbox_rows().await, 10);

    sqlx::query(sqlx::AssertSqlSafe(format!("SELECT RELEASE_LOCK({name})")))
        .bind("idempotent_inbox")
        .execute(&mut *other)
        .await
        .unwrap();
    assert_eq!(h.inbox.purge_expired(100).await.unwrap().deleted, 10);
}
