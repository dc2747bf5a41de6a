//! The inbox on a PostgreSQL primary with a streaming standby (`scripts/postgres-ha`, whose
//! `IDEMPOTENT_PG_HA_CTL` starts the pair, fails over and names the primary): what sqlx offers to
//! find the primary, a claim that reaches a standby, and what a failover keeps and loses under
//! synchronous and asynchronous replication. The chaos runs (`tests/chaos/`, backends
//! `postgres-ha-sync` and `postgres-ha-async`) do the same under load, with consumers killed.
//!
//! The tests share the pair, so they take turns; each starts it in the mode it needs.
#![cfg(feature = "postgres")]

use std::time::Duration;

use idempotent::{Error, Handled, Inbox, InboxError, idempotent};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};
use tokio::sync::Mutex;

/// One test at a time on the pair.
static PAIR: Mutex<()> = Mutex::const_new(());

#[derive(Debug, thiserror::Error)]
#[error("database error in the handler")]
struct ShopError(#[from] sqlx::Error);

struct Payment {
    id: String,
}

#[idempotent(key = "id", consumer = "payments")]
async fn record_payment(tx: &mut sqlx::PgConnection, msg: &Payment) -> Result<(), ShopError> {
    sqlx::query("INSERT INTO payments (id) VALUES ($1)")
        .bind(&msg.id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// Runs a command of `scripts/postgres-ha`; what it printed.
fn ctl(args: &str) -> String {
    let ctl = std::env::var("IDEMPOTENT_PG_HA_CTL").expect(
        "IDEMPOTENT_PG_HA_CTL is not set: run the tests with scripts/test, which starts scripts/postgres-ha",
    );
    let output = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{ctl} {args}"))
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "postgres-ha {args}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// The pair in `mode` (`sync` or `async`): the primary's and the standby's URLs, with a fresh
/// database holding the inbox and a `payments` table, which the standby has replayed.
async fn pair(mode: &str) -> (String, String) {
    let started = ctl(&format!("start {mode}"));
    let urls = started
        .lines()
        .find_map(|line| line.strip_prefix("export IDEMPOTENT_PG_HA_URLS="))
        .expect("the pair's URLs");
    let (primary, standby) = urls.split_once(',').unwrap();
    let database = format!("t_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(primary).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&mut admin)
        .await
        .unwrap();
    let with_db = |url: &str| format!("{}/{database}", url.rsplit_once('/').unwrap().0);
    let (primary, standby) = (with_db(primary), with_db(standby));
    let pool = PgPool::connect(&primary).await.unwrap();
    sqlx::query("CREATE TABLE payments (id TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    Inbox::new(pool.clone()).migrate().await.unwrap();
    // The standby replays all of it a moment later (a synchronous commit waits for the standby to
    // write the WAL, not to apply it): once it has replayed up to the primary's WAL position now.
    let written: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    for _ in 0..1200 {
        if let Ok(mut conn) = sqlx::PgConnection::connect(&standby).await {
            let replayed: Result<bool, _> =
                sqlx::query_scalar("SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn")
                    .bind(&written)
                    .fetch_one(&mut conn)
                    .await;
            if let Ok(true) = replayed {
                return (primary, standby);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the standby never replayed the new tables");
}

async fn payments(url: &str) -> Vec<String> {
    let pool = PgPool::connect(url).await.unwrap();
    let mut ids: Vec<String> = sqlx::query_scalar("SELECT id FROM payments ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    ids.sort();
    ids
}

/// The URL of the current primary, with `database`'s name taken from `like`.
fn primary_now(like: &str) -> String {
    let primary = ctl("primary");
    format!(
        "{}/{}",
        primary.trim().rsplit_once('/').unwrap().0,
        like.rsplit_once('/').unwrap().1
    )
}

/// sqlx 0.9 connects to one host: a URL with a list of hosts does not parse, and
/// `target_session_attrs=read-write` is ignored (with a warning), so such a URL to the standby
/// gives a session on the standby. Finding the primary is the application's business: see the
/// chaos consumer's reconnect rule (`tests/chaos/failover.rs`) and the README.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_takes_one_host_and_ignores_target_session_attrs() {
    let _turn = PAIR.lock().await;
    let (primary, standby) = pair("sync").await;
    let port = |url: &str| url.split(':').nth(2).unwrap()[..5].to_owned();
    let list = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres",
        port(&primary),
        port(&standby)
    );
    assert!(list.parse::<PgConnectOptions>().is_err(), "{list}");
    let options: PgConnectOptions = format!("{standby}?target_session_attrs=read-write")
        .parse()
        .unwrap();
    let mut conn = options.connect().await.unwrap();
    let standby_session: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert!(standby_session, "sqlx found the primary after all");
}

/// A consumer whose connection reaches a standby (a failed primary brought back as one, a standby
/// not yet promoted, a virtual IP that has not moved yet): its claim is refused as read-only
/// (25006), which is retryable and closes the connection, so that the redelivery's connection may
/// reach the primary. Nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_on_a_standby_is_retryable_and_closes_its_connection() {
    let _turn = PAIR.lock().await;
    let (primary, standby) = pair("sync").await;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&standby)
        .await
        .unwrap();
    let inbox = Inbox::new(pool.clone());
    let error = record_payment(&inbox, &Payment { id: "p-1".into() })
        .await
        .unwrap_err();
    match &error {
        Error::Inbox(InboxError::Database { source, .. }) => {
            let code = source.as_database_error().and_then(|e| e.code());
            assert_eq!(code.as_deref(), Some("25006"), "{error:?}");
        }
        other => panic!("expected a database error, got {other:?}"),
    }
    assert!(error.is_retryable(), "{error:?}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(pool.size(), 0, "the connection to the standby was kept");
    let done = record_payment(
        &Inbox::new(PgPool::connect(&primary).await.unwrap()),
        &Payment { id: "p-1".into() },
    )
    .await
    .unwrap();
    assert!(done.is_processed());
}

/// Synchronous replication: every message whose handler returned `Processed` before the primary
/// died is on the promoted standby, effect and inbox row: its redelivery is a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synchronous_replication_keeps_every_acknowledged_message_across_a_failover() {
    let _turn = PAIR.lock().await;
    let (primary, _) = pair("sync").await;
    let inbox = Inbox::new(PgPool::connect(&primary).await.unwrap());
    let ids: Vec<String> = (0..50).map(|i| format!("sync-{i:02}")).collect();
    for id in &ids {
        let done = record_payment(&inbox, &Payment { id: id.clone() })
            .await
            .unwrap();
        assert!(done.is_processed());
    }
    ctl("failover");
    let promoted = primary_now(&primary);
    assert_ne!(promoted, primary);
    assert_eq!(payments(&promoted).await, ids);
    let inbox = Inbox::new(PgPool::connect(&promoted).await.unwrap());
    for id in &ids {
        let again = record_payment(&inbox, &Payment { id: id.clone() })
            .await
            .unwrap();
        assert!(again.is_duplicate(), "{id}: {again:?}");
    }
}

/// Asynchronous replication, with the standby a few seconds behind when the primary dies: the
/// messages processed meanwhile were acknowledged and are gone from the promoted standby, each
/// whole (its effect and its inbox row, one transaction), so their redelivery processes them once.
/// A broker that was told they were done does not redeliver them: that loss is the price of
/// asynchronous replication, and the README says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_replication_loses_recent_messages_whole_across_a_failover() {
    let _turn = PAIR.lock().await;
    let (primary, _) = pair("async").await;
    let inbox = Inbox::new(PgPool::connect(&primary).await.unwrap());
    let before: Vec<String> = (0..10).map(|i| format!("before-{i:02}")).collect();
    for id in &before {
        assert!(
            record_payment(&inbox, &Payment { id: id.clone() })
                .await
                .unwrap()
                .is_processed()
        );
    }
    // Everything so far is on the standby before its receiver is paused.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let failover = tokio::task::spawn_blocking(|| ctl("failover 3"));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let during: Vec<String> = (0..20).map(|i| format!("during-{i:02}")).collect();
    for id in &during {
        let done = record_payment(&inbox, &Payment { id: id.clone() }).await;
        assert!(matches!(done, Ok(Handled::Processed(()))), "{id}: {done:?}");
    }
    failover.await.unwrap();
    let promoted = primary_now(&primary);
    let pool = PgPool::connect(&promoted).await.unwrap();
    assert_eq!(
        payments(&promoted).await,
        before,
        "the lagging standby had more"
    );
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotent_inbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        rows,
        before.len() as i64,
        "an inbox row outlived its effect, or the other way round"
    );
    let inbox = Inbox::new(pool);
    for id in &during {
        let again = record_payment(&inbox, &Payment { id: id.clone() })
            .await
            .unwrap();
        assert!(again.is_processed(), "{id}: {again:?}");
    }
    for id in &before {
        let again = record_payment(&inbox, &Payment { id: id.clone() })
            .await
            .unwrap();
        assert!(again.is_duplicate(), "{id}: {again:?}");
    }
    let mut all = [before, during].concat();
    all.sort();
    assert_eq!(payments(&promoted).await, all);
}
