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

    forget_never_waits_for_a_handler(url, &inbox).await;

    // With a retention of zero, everything before now is expired.
    let preview = json(url, &["purge", "--retention", "0s", "--dry-run"]);
    assert_eq!(preview["dry_run"], true);
    let orders = consumer(&preview, "orders");
    assert_eq!(
        (orders["rows"].as_u64(), orders["audit"].as_u64()),
        (Some(2), Some(2))
    );
    let billing = consumer(&preview, "billing");
    assert_eq!(
        (billing["rows"].as_u64(), billing["calls"].as_u64()),
        (Some(1), Some(1))
    );
    let stats = json(url, &["stats"]);
    assert_eq!(
        stats["consumers"].as_array().unwrap().len(),
        2,
        "a dry run deletes nothing"
    );
    for short in [
        &["--retention", "0s"][..],
        &["--retention", "59s"],
        &["--retention", "1d", "--consumer-retention", "billing=0s"],
        &["--retention", "1d", "--outbox-retention", "500ms"],
    ] {
        let refused = idempotent(url, &[&["purge"], short].concat());
        let said = String::from_utf8_lossy(&refused.stderr);
        assert_eq!(refused.status.code(), Some(1), "purge {short:?}: {said}");
        assert!(said.contains("--yes-delete-recent"), "{said}");
    }
    assert_eq!(
        json(url, &["stats"]),
        stats,
        "a refused purge deletes nothing"
    );
    let kept = json(
        url,
        &[
            "purge",
            "--retention",
            "1d",
            "--consumer-retention",
            "billing=0s",
            "--yes-delete-recent",
        ],
    );
    assert_eq!(
        (kept["rows"].as_u64(), kept["calls"].as_u64()),
        (Some(1), Some(1))
    );
    let purged = json(url, &["purge", "--retention", "0s", "--yes-delete-recent"]);
    assert_eq!(
        (purged["rows"].as_u64(), purged["audit"].as_u64()),
        (Some(2), Some(2))
    );
    let stats = json(url, &["stats"]);
    let orders = consumer(&stats, "orders");
    assert_eq!(orders["rows"], 0, "{stats}");
    assert!(
        orders["horizon"].is_string(),
        "the purge recorded a horizon: {stats}"
    );

    outbox(url, &inbox).await;
    outbox_held_and_skip(url, &inbox).await;
}

/// `forget` of a key a handler holds (claimed, not committed) answers at once, on every backend,
/// that there is no committed record (exit 2), and forgets nothing; once the handler commits, the
/// key is forgotten.
async fn forget_never_waits_for_a_handler<DB: Backend>(url: &str, inbox: &Inbox<DB>) {
    let args = [
        "forget",
        "--consumer",
        "orders",
        "--key",
        "order-held",
        "--reason",
        "held",
    ];
    let held = inbox.claim("orders", "order-held").await.unwrap().unwrap();
    // The handler's transaction stays open until the command has answered.
    let answer = idempotent(url, &args);
    let said = String::from_utf8_lossy(&answer.stderr);
    assert_eq!(answer.status.code(), Some(2), "{said}");
    assert!(said.contains("no committed record"), "{said}");
    held.commit().await.unwrap();
    assert!(inbox.is_processed("orders", "order-held").await.unwrap());
    assert_eq!(json(url, &args)["forgotten"], true);
    assert!(!inbox.is_processed("orders", "order-held").await.unwrap());
    let audit = json(url, &["audit", "--consumer", "orders"]);
    assert_eq!(audit["audit"].as_array().unwrap().len(), 2, "{audit}");
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

/// A broker that refuses the messages of one ordering key and takes the rest.
struct RefusingKey(&'static str);

impl Publisher for RefusingKey {
    async fn publish(&self, publication: &Publication) -> Result<(), PublishError> {
        if publication.ordering_key.as_deref() == Some(self.0) {
            return Err(PublishError::rejected("no queue bound"));
        }
        Ok(())
    }
}

/// `outbox held` lists the key a parked message holds (relays with `parked_holds_key`), with the
/// message and what waits behind it; `outbox skip` gives the message up (shown as skipped, counted
/// by `stats`), after which the key goes on; skipping a row that is not parked exits with 2 and
/// says so, as `retry` does.
async fn outbox_held_and_skip<DB: Backend>(url: &str, inbox: &Inbox<DB>) {
    let mut claimed = inbox.claim("shipping", "order-9").await.unwrap().unwrap();
    for event in ["order.packed", "order.shipped"] {
        claimed.outbox().send(
            OutgoingMessage::new(Destination::exchange("shop", event), b"{}".to_vec())
                .with_ordering_key("order-9"),
        );
    }
    claimed.commit().await.unwrap();
    let holding = RelayOptions::default()
        .attempts(1, Duration::from_secs(60))
        .parked_holds_key(true);
    let broker = RefusingKey("order-9");
    let report = inbox.relay_once(&broker, &holding).await.unwrap();
    assert_eq!(report.parked, 1, "{report:?}");
    let report = inbox.relay_once(&broker, &holding).await.unwrap();
    assert_eq!(report.taken, 0, "the held key's second message was taken");

    let held = json(url, &["outbox", "held"]);
    let keys = held["held"].as_array().unwrap();
    assert_eq!(keys.len(), 1, "{held}");
    assert_eq!(keys[0]["ordering_key"], "order-9");
    assert_eq!(keys[0]["parked"]["routing_key"], "order.packed");
    assert_eq!(keys[0]["parked"]["state"], "parked");
    assert_eq!(keys[0]["waiting"], 1);
    assert!(keys[0]["oldest_waiting"].is_string(), "{held}");
    let row = keys[0]["parked"]["row"].as_i64().unwrap().to_string();
    let table = idempotent(url, &["outbox", "held"]);
    let table = String::from_utf8_lossy(&table.stdout).to_string();
    assert!(
        table.starts_with("ORDERING KEY") && table.contains("order-9"),
        "{table}"
    );
    assert!(table.contains("shop / order.packed"), "{table}");

    let not_parked = "is not a parked outgoing message: nothing skipped";
    let missing = idempotent(url, &["outbox", "skip", "--row", "999999"]);
    let said = String::from_utf8_lossy(&missing.stderr);
    assert_eq!(missing.status.code(), Some(2), "{said}");
    assert!(said.contains(not_parked), "{said}");
    let skipped = json(url, &["outbox", "skip", "--row", &row]);
    assert_eq!(skipped["skipped"], true);
    let again = idempotent(url, &["outbox", "skip", "--row", &row]);
    let said = String::from_utf8_lossy(&again.stderr);
    assert_eq!(again.status.code(), Some(2), "skipped twice: {said}");
    assert!(said.contains(not_parked), "{said}");
    let retried = idempotent(url, &["outbox", "retry", "--row", &row]);
    assert_eq!(retried.status.code(), Some(2), "a skipped row retried");

    let shown = json(url, &["outbox", "show", "--row", &row]);
    assert_eq!(shown["outgoing"][0]["state"], "skipped");
    assert!(shown["outgoing"][0]["sent_at"].is_string(), "{shown}");
    assert_eq!(json(url, &["outbox", "stats"])["skipped"], 1);
    let stats = idempotent(url, &["outbox", "stats"]);
    assert!(String::from_utf8_lossy(&stats.stdout).contains("SKIPPED"));
    assert_eq!(json(url, &["outbox", "held"])["held"], Value::Array(vec![]));
    // The key goes on: its second message is refused now, not held.
    let report = inbox.relay_once(&broker, &holding).await.unwrap();
    assert_eq!((report.taken, report.parked), (1, 1), "{report:?}");
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

/// Every JSON value a command printed, one after another.
fn json_values(out: &Output) -> Vec<Value> {
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::Deserializer::from_slice(&out.stdout)
        .into_iter()
        .collect::<Result<_, _>>()
        .expect("--json prints JSON")
}

#[tokio::test]
async fn migrate_takes_every_tenant_by_schema_or_by_database() {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let base = std::env::var("IDEMPOTENT_PG_URL")
        .expect("IDEMPOTENT_PG_URL is not set: run the tests with scripts/test");
    let admin = sqlx::PgPool::connect(&base).await.unwrap();
    let schemas: Vec<String> = ["a", "b", "c"].map(|t| format!("cli_{t}_{id}")).into();
    for schema in &schemas {
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&admin)
            .await
            .unwrap();
    }
    let listed = schemas.join(",");
    let migrated = json_values(&idempotent(
        &base,
        &["--schema", &listed, "migrate", "--json"],
    ));
    assert_eq!(migrated.len(), 3, "{migrated:?}");
    for (schema, migration) in schemas.iter().zip(&migrated) {
        assert_eq!(migration["schema"], schema.as_str());
        assert_eq!(migration["from"], 0, "{schema}: tables found elsewhere");
        let made: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(format!("{schema}.idempotent_inbox_outbox"))
            .fetch_one(&admin)
            .await
            .unwrap();
        assert!(made, "{schema} has no outbox table");
    }
    let again = idempotent(&base, &["--schema", &schemas[1], "migrate"]);
    let said = String::from_utf8_lossy(&again.stdout);
    assert!(
        said.contains(&format!("{}.idempotent_inbox: schema version", schemas[1]))
            && said.contains("nothing to do"),
        "{said}"
    );
    // Any command on one tenant's schema: its tables, not the connection's.
    let inbox = Inbox::new(sqlx::PgPool::connect(&base).await.unwrap())
        .with_schema(&schemas[2])
        .unwrap();
    inbox
        .claim("orders", "order-1")
        .await
        .unwrap()
        .unwrap()
        .commit()
        .await
        .unwrap();
    let stats = json(&base, &["--schema", &schemas[2], "stats"]);
    assert_eq!(consumer(&stats, "orders")["rows"], 1);
    let stats = json(&base, &["--schema", &schemas[0], "stats"]);
    assert_eq!(
        stats["consumers"].as_array().map(Vec::len),
        Some(0),
        "{stats}"
    );
    refused(
        &base,
        &["--schema", &listed, "stats"],
        "only migrate takes several",
    );
    let ddl = idempotent(&base, &["--schema", "acme", "ddl"]);
    let ddl = String::from_utf8_lossy(&ddl.stdout);
    assert!(
        ddl.contains(r#"CREATE TABLE IF NOT EXISTS "acme"."idempotent_inbox" ("#)
            && ddl.contains(r#"INDEX IF NOT EXISTS "idempotent_inbox_processed_at" ON "acme"."idempotent_inbox""#),
        "{ddl}"
    );
    refused(
        &base,
        &["--schema", "Bad-Name", "migrate"],
        "invalid schema name",
    );

    // By database on MariaDB: several URLs.
    let base = std::env::var("IDEMPOTENT_MYSQL_URL")
        .expect("IDEMPOTENT_MYSQL_URL is not set: run the tests with scripts/test");
    let admin = sqlx::MySqlPool::connect(&base).await.unwrap();
    let (server, _) = base.rsplit_once('/').expect("a URL with a database");
    let mut urls = Vec::new();
    for tenant in ["a", "b"] {
        let database = format!("cli_{tenant}_{id}");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
            .execute(&admin)
            .await
            .unwrap();
        urls.push(format!("{server}/{database}"));
    }
    let out = Command::new(BIN)
        .args(["--url", &urls[0], "--url", &urls[1], "migrate", "--json"])
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    let migrated = json_values(&out);
    assert_eq!(migrated.len(), 2, "{migrated:?}");
    for (n, migration) in migrated.iter().enumerate() {
        assert_eq!(
            (migration["url"].as_u64(), migration["from"].as_u64()),
            (Some(n as u64 + 1), Some(0))
        );
    }
    refused(
        &urls[0],
        &["--schema", "a", "migrate"],
        "--schema is PostgreSQL's",
    );
}

/// An SQLite database in a temporary folder with the inbox's tables, for the commands' checks of
/// their input.
fn migrated_sqlite() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("inbox.db").display());
    let migrated = idempotent(&url, &["migrate"]);
    assert!(migrated.status.success(), "{migrated:?}");
    (dir, url)
}

/// Asserts that the command was refused with exit 1 and a sentence that says `says`, not a panic
/// (exit 101) nor a success.
fn refused(url: &str, args: &[&str], says: &str) {
    let out = idempotent(url, args);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {said}");
    assert!(said.contains(says), "{args:?} says {said:?}, not {says:?}");
    assert!(!said.contains("panicked"), "{args:?}: {said}");
    assert!(out.stdout.is_empty(), "{args:?} printed {:?}", out.stdout);
}

#[test]
fn a_time_too_far_back_is_refused_with_a_sentence() {
    let (_dir, url) = migrated_sqlite();
    for option in ["--since", "--until"] {
        for ago in ["999999999999d", "18446744073709551615s"] {
            refused(
                &url,
                &["inspect", "--consumer", "orders", option, ago],
                "before 1970",
            );
        }
    }
    refused(
        &url,
        &[
            "inspect",
            "--consumer",
            "orders",
            "--since",
            "99999999999-01-01T00:00:00Z",
        ],
        "is not a time",
    );
}

#[test]
fn a_consumer_retention_without_a_consumer_is_refused() {
    let (_dir, url) = migrated_sqlite();
    for empty in ["=1d", " =1d"] {
        refused(
            &url,
            &["purge", "--retention", "14d", "--consumer-retention", empty],
            "names no consumer",
        );
    }
}

#[test]
fn ddl_of_an_unknown_version_is_refused() {
    refused(
        "postgres://",
        &["ddl", "--from", "99"],
        "no schema version 99",
    );
    let latest = idempotent::schema::CURRENT_VERSION.to_string();
    let out = idempotent("sqlite://x.db", &["ddl", "--from", &latest]);
    assert!(out.status.success() && out.stdout.is_empty(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("nothing to run"));
    let before = (latest.parse::<u32>().unwrap() - 1).to_string();
    let out = idempotent("mysql://", &["ddl", "--from", &before]);
    assert!(out.status.success() && !out.stdout.is_empty(), "{out:?}");
}

/// Every `--limit` is at least 1: 0 is refused, by every command that has one.
#[test]
fn a_limit_of_zero_is_refused_by_every_command() {
    let (_dir, url) = migrated_sqlite();
    for command in [
        &["inspect", "--consumer", "orders"][..],
        &["stuck"],
        &["audit"],
        &["outbox", "parked"],
        &["outbox", "held"],
    ] {
        refused(&url, &[command, &["--limit", "0"]].concat(), "at least 1");
    }
}

/// A read command on a database that is not there (a mistyped path) says so, and leaves no empty
/// database behind; only `migrate` creates one.
#[test]
fn a_command_on_a_missing_sqlite_database_creates_none() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("typo.db");
    let url = format!("sqlite://{}", path.display());
    for command in [
        &["stats"][..],
        &["inspect", "--consumer", "orders", "--key", "order-1"],
        &["audit"],
        &["outbox", "stats"],
        &["purge", "--retention", "14d"],
        &[
            "forget",
            "--consumer",
            "orders",
            "--key",
            "order-1",
            "--reason",
            "typo",
        ],
    ] {
        refused(&url, command, &format!("no database at {}", path.display()));
        assert!(!path.exists(), "{command:?} created {}", path.display());
    }
    assert!(idempotent(&url, &["migrate"]).status.success());
    assert!(path.exists());
}

/// A port nothing listens on.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// A server that cannot be reached fails the command with the cause ("Connection refused"), said
/// once, rather than the pool's "pool timed out" after its wait.
#[test]
fn an_unreachable_server_is_reported_with_its_cause_once() {
    let port = closed_port();
    for url in [
        format!("postgres://postgres@127.0.0.1:{port}/postgres"),
        format!("mysql://idempotent:idempotent@127.0.0.1:{port}/mysql"),
    ] {
        let out = idempotent(&url, &["stats"]);
        let said = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{url}: {said}");
        assert!(!said.contains("timed out"), "{url}: {said}");
        assert_eq!(
            said.matches("Connection refused").count(),
            1,
            "{url}: the cause said once: {said}"
        );
    }
}

/// A command line that is wrong exits with 1, like every error: 2 says "not found".
#[test]
fn a_wrong_command_line_exits_with_1() {
    let out = idempotent("sqlite://x.db", &["inspect", "--limit", "many"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let help = idempotent("sqlite://x.db", &["purge", "--help"]);
    assert!(help.status.success());
    assert!(String::from_utf8_lossy(&help.stdout).contains("--yes-delete-recent"));
}
