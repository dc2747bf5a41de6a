//! The built `idempotent` binary against real databases: SQLite in a temporary folder, and the
//! PostgreSQL and MariaDB of `IDEMPOTENT_PG_URL` and `IDEMPOTENT_MYSQL_URL` (a fresh schema or
//! database each), as `scripts/test` and CI start them.

use std::process::{Command, Output};
use std::time::Duration;

use idempotent::outbox::{
    Destination, OutgoingMessage, Publication, PublishError, Publisher, RelayOptions,
};
use idempotent::sqlx;
use idempotent::{Backend, ClaimOptions, Inbox, message_key};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_idempotent");

fn idempotent(url: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("--url")
        .arg(url)
        .args(args)
        .env_remove("DATABASE_URL")
        .output()
        .expect("run the idempotent binary")
}

/// Runs a command with `--json` that must succeed, and parses what it printed.
fn json(url: &str, args: &[&str]) -> Value {
    let mut args = args.to_vec();
    args.push("--json");
    let out = idempotent(url, &args);
    assert!(
        out.status.success(),
        "idempotent {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("--json prints JSON")
}

fn consumer<'a>(stats: &'a Value, name: &str) -> &'a Value {
    stats["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["consumer"] == name)
        .unwrap_or_else(|| panic!("no {name} in {stats}"))
}

/// Everything the binary does, on the database at `url`, whose tables it creates; `inbox` (on the
/// same database) writes what it then looks at.
async fn exercise<DB: Backend>(url: &str, inbox: Inbox<DB>) {
    let ddl = idempotent(url, &["ddl"]);
    assert!(ddl.status.success());
    assert!(String::from_utf8_lossy(&ddl.stdout).contains("CREATE TABLE IF NOT EXISTS"));

    let migrated = json(url, &["migrate"]);
    let current = u64::from(idempotent::schema::CURRENT_VERSION);
    assert_eq!(
        (migrated["from"].as_u64(), migrated["to"].as_u64()),
        (Some(0), Some(current))
    );
    let again = json(url, &["migrate"]);
    assert_eq!(again["from"], again["to"]);

    for key in ["order-1", "order-2", "order-3"] {
        let claimed = inbox.claim("orders", key).await.unwrap().unwrap();
        claimed.commit().await.unwrap();
    }
    let options = ClaimOptions {
        fingerprint: Some(&[9; 32]),
        ..ClaimOptions::default()
    };
    match inbox
        .claim_with("billing", "order-1", options)
        .await
        .unwrap()
    {
        idempotent::Claim::New(claimed) => claimed.commit().await.unwrap(),
        idempotent::Claim::Duplicate { .. } => panic!("a fresh key"),
    }
    let key = message_key("order-1").unwrap();
    let short = Duration::from_millis(20);
    inbox
        .begin_call::<String>("billing", &key, "charge", short)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;

    let stats = json(url, &["stats"]);
    assert_eq!(consumer(&stats, "orders")["rows"], 3);
    let billing = consumer(&stats, "billing");
    assert_eq!(
        (billing["rows"].as_u64(), billing["pending_calls"].as_u64()),
        (Some(1), Some(1))
    );
    assert!(billing["horizon"].is_null());
    let table = idempotent(url, &["stats"]);
    let table = String::from_utf8_lossy(&table.stdout).to_string();
    assert!(
        table.starts_with("CONSUMER") && table.contains("orders"),
        "{table}"
    );

    let record = json(
        url,
        &["inspect", "--consumer", "billing", "--key", "order-1"],
    );
    assert_eq!(record["key_readable"], "\"order-1\"");
    assert_eq!(record["fingerprint"], "09".repeat(32));
    let stored = record["key"].as_str().unwrap().to_owned();
    let by_stored = json(
        url,
        &[
            "inspect",
            "--consumer",
            "billing",
            "--key",
            &format!("stored:{stored}"),
        ],
    );
    assert_eq!(by_stored["processed_at"], record["processed_at"]);
    let missing = idempotent(
        url,
        &["inspect", "--consumer", "orders", "--key", "order-9"],
    );
    assert_eq!(
        missing.status.code(),
        Some(2),
        "a missing record exits with 2"
    );

    let first = json(url, &["inspect", "--consumer", "orders", "--limit", "2"]);
    assert_eq!(first["records"].as_array().unwrap().len(), 2);
    let next = first["next"]
        .as_str()
        .expect("a full page has a cursor")
        .to_owned();
    let second = json(
        url,
        &[
            "inspect",
            "--consumer",
            "orders",
            "--limit",
            "2",
            "--after",
            &next,
        ],
    );
    assert_eq!(second["records"].as_array().unwrap().len(), 1);
    assert!(second["next"].is_null());
    let none = json(
        url,
        &[
            "inspect",
            "--consumer",
            "orders",
            "--until",
            "2000-01-01T00:00:00Z",
        ],
    );
    assert!(none["records"].as_array().unwrap().is_empty());

    let stuck = json(url, &["stuck"]);
    let stuck = stuck["stuck_calls"].as_array().unwrap();
    assert_eq!(stuck.len(), 1);
    assert_eq!(
        (stuck[0]["consumer"].as_str(), stuck[0]["call"].as_str()),
        (Some("billing"), Some("charge"))
    );

    let no_reason = idempotent(url, &["forget", "--consumer", "orders", "--key", "order-2"]);
    assert!(!no_reason.status.success());
    assert!(String::from_utf8_lossy(&no_reason.stderr).contains("--reason"));
    let forgotten = json(
        url,
        &[
            "forget",
            "--consumer",
            "orders",
            "--key",
            "order-2",
            "--reason",
            "replay after the fix",
        ],
    );
    assert_eq!(forgotten["forgotten"], true);
    assert!(!inbox.is_processed("orders", "order-2").await.unwrap());
    let twice = idempotent(
        url,
        &[
            "forget",
            "--consumer",
            "orders",
            "--key",
            "order-2",
            "--reason",
            "again",
        ],
    );
    assert_eq!(twice.status.code(), Some(2));
    let audit = json(url, &["audit", "--consumer", "orders"]);
    let audit = audit["audit"].as_array().unwrap();
    assert_eq!(audit.len(), 1);
    assert_eq!(audit[0]["reason"], "replay after the fix");
    assert_eq!(
        audit[0]["key_digest"],
        message_key("order-2").unwrap().full_digest()
    );

    // With a retention of zero, everything before now is expired.
    let preview = json(url, &["purge", "--retention", "0s", "--dry-run"]);
    assert_eq!(preview["dry_run"], true);
    let orders = consumer(&preview, "orders");
    assert_eq!(
        (orders["rows"].as_u64(), orders["audit"].as_u64()),
        (Some(2), Some(1))
    );
    let billing = consumer(&preview, "billing");
    assert_eq!(
        (billing["rows"].as_u64(), billing["calls"].as_u64()),
        (Some(1), Some(1))
    );
    assert_eq!(
        json(url, &["stats"])["consumers"].as_array().unwrap().len(),
        2,
        "a dry run deletes nothing"
    );
    let kept = json(
        url,
        &[
            "purge",
            "--retention",
            "1d",
            "--consumer-retention",
            "billing=0s",
        ],
    );
    assert_eq!(
        (kept["rows"].as_u64(), kept["calls"].as_u64()),
        (Some(1), Some(1))
    );
    let purged = json(url, &["purge", "--retention", "0s"]);
    assert_eq!(
        (purged["rows"].as_u64(), purged["audit"].as_u64()),
        (Some(2), Some(1))
    );
    let stats = json(url, &["stats"]);
    let orders = consumer(&stats, "orders");
    assert_eq!(orders["rows"], 0, "{stats}");
    assert!(
        orders["horizon"].is_string(),
        "the purge recorded a horizon: {stats}"
    );

    outbox(url, &inbox).await;
}

/// A broker that refuses everything.
struct Refusing;

impl Publisher for Refusing {
    async fn publish(&self, _: &Publication) -> Result<(), PublishError> {
        Err(PublishError::rejected("no queue bound"))
    }
}

/// The `outbox` commands: a message parked by a relay shows in `stats`, `parked` and `show`, and
/// `retry` makes it pending again, once.
async fn outbox<DB: Backend>(url: &str, inbox: &Inbox<DB>) {
    let mut claimed = inbox.claim("shipping", "order-5").await.unwrap().unwrap();
    let id = claimed.outbox().send(OutgoingMessage::new(
        Destination::exchange("shop", "order.shipped"),
        b"{}".to_vec(),
    ));
    claimed.commit().await.unwrap();
    let park_at_once = RelayOptions::default().attempts(1, Duration::from_secs(60));
    let report = inbox.relay_once(&Refusing, &park_at_once).await.unwrap();
    assert_eq!(report.parked, 1);

    let stats = json(url, &["outbox", "stats"]);
    assert_eq!(
        (stats["pending"].as_u64(), stats["parked"].as_u64()),
        (Some(0), Some(1))
    );
    let parked = json(url, &["outbox", "parked"]);
    let parked = parked["outgoing"].as_array().unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0]["message_id"], id.as_str());
    assert_eq!(parked[0]["state"], "parked");
    assert_eq!(parked[0]["last_error"], "no queue bound");
    assert_eq!(parked[0]["exchange"], "shop");
    let row = parked[0]["row"].as_i64().unwrap().to_string();
    let table = idempotent(url, &["outbox", "parked"]);
    let table = String::from_utf8_lossy(&table.stdout).to_string();
    assert!(
        table.starts_with("ROW") && table.contains("shop / order.shipped"),
        "{table}"
    );

    let retried = json(url, &["outbox", "retry", "--row", &row]);
    assert_eq!(retried["retried"], true);
    let again = idempotent(url, &["outbox", "retry", "--row", &row]);
    assert_eq!(again.status.code(), Some(2), "a row that is not parked");
    let shown = json(url, &["outbox", "show", "--message-id", &id]);
    assert_eq!(shown["outgoing"][0]["state"], "pending");
    let missing = idempotent(url, &["outbox", "show", "--row", "999999"]);
    assert_eq!(missing.status.code(), Some(2));
    assert_eq!(json(url, &["outbox", "stats"])["pending"], 1);
}

#[tokio::test]
async fn the_binary_operates_an_sqlite_inbox() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("inbox.db").display());
    let pool = sqlx::SqlitePool::connect_with(idempotent::sqlite::connect_options(&url).unwrap())
        .await
        .unwrap();
    exercise(&url, Inbox::new(pool)).await;
    let bad = idempotent("oracle://x", &["stats"]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown database"));
}

#[tokio::test]
async fn the_binary_operates_a_postgres_inbox() {
    let base = std::env::var("IDEMPOTENT_PG_URL")
        .expect("IDEMPOTENT_PG_URL is not set: run the tests with scripts/test");
    let schema = format!("cli_{}", uuid::Uuid::new_v4().simple());
    let admin = sqlx::PgPool::connect(&base).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .unwrap();
    let separator = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{separator}options=-c%20search_path%3D{schema}");
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    exercise(&url, Inbox::new(pool)).await;
}

#[tokio::test]
async fn the_binary_operates_a_mysql_inbox() {
    let base = std::env::var("IDEMPOTENT_MYSQL_URL")
        .expect("IDEMPOTENT_MYSQL_URL is not set: run the tests with scripts/test");
    let database = format!("cli_{}", uuid::Uuid::new_v4().simple());
    let admin = sqlx::MySqlPool::connect(&base).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&admin)
        .await
        .unwrap();
    let (server, _) = base.rsplit_once('/').expect("a URL with a database");
    let url = format!("{server}/{database}");
    let pool = sqlx::MySqlPool::connect(&url).await.unwrap();
    exercise(&url.replacen("mysql:", "mariadb:", 1), Inbox::new(pool)).await;
}
