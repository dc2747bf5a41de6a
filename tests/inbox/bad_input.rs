//! A catalogue of bad input and bad luck, each with its typed error or documented behaviour, and
//! nothing half-committed: hostile table names, a database connection that dies in the body or
//! just before the commit, an exhausted pool. (Empty, huge, NUL-byte and non-UTF-8 keys, panics,
//! cancellation and handlers that always fail are in the conformance suite, on every backend.)
#![cfg(all(feature = "postgres", feature = "sqlite"))]

#[path = "../support/mod.rs"]
mod support;

use std::sync::Mutex;
use std::time::Duration;

use idempotent::{Error, Handled, Inbox, InboxError, Stage, idempotent};
use sqlx::postgres::PgPoolOptions;
use tokio::sync::{mpsc, oneshot};

use support::postgres::PgHarness;
use support::sqlite::SqliteHarness;

const HOSTILE_TABLE_NAMES: [&str; 8] = [
    "inbox; DROP TABLE victim",
    "inbox\"; DROP TABLE victim; --",
    "inbox'",
    "`inbox`",
    "Inbox",
    "",
    "a_name_that_is_much_longer_than_forty_eight_characters",
    "inbox\0",
];

#[tokio::test]
async fn hostile_table_names_are_refused_before_any_sql() {
    let sqlite = SqliteHarness::new().await;
    let pg = PgHarness::new().await;
    sqlx::query("CREATE TABLE victim (id INTEGER)")
        .execute(&sqlite.pool)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE victim (id INTEGER)")
        .execute(&pg.pool)
        .await
        .unwrap();
    for name in HOSTILE_TABLE_NAMES {
        let error = Inbox::new(sqlite.pool.clone())
            .with_table(name)
            .unwrap_err();
        assert!(
            matches!(&error, InboxError::TableName { name: n, .. } if n == name),
            "{name:?}: {error:?}"
        );
        assert!(!error.is_retryable());
        assert!(Inbox::new(pg.pool.clone()).with_table(name).is_err());
    }
    // Nothing ran: the victim tables are still there.
    sqlx::query("SELECT COUNT(*) FROM victim")
        .execute(&sqlite.pool)
        .await
        .unwrap();
    sqlx::query("SELECT COUNT(*) FROM victim")
        .execute(&pg.pool)
        .await
        .unwrap();

    // A well-formed name that is also an SQL keyword works, quoted.
    let inbox = Inbox::new(pg.pool.clone()).with_table("select").unwrap();
    inbox.migrate().await.unwrap();
    let key = idempotent::message_key("m-1").unwrap();
    let claimed = inbox.claim("orders", &key).await.unwrap().unwrap();
    claimed.commit().await.unwrap();
    assert!(inbox.claim("orders", &key).await.unwrap().is_none());
}

/// A message for the handlers below; the channels let a test act while the body runs.
struct Risky {
    message_id: String,
    /// The body sends its connection's backend pid here, then waits for the go-ahead.
    pid: Mutex<Option<oneshot::Sender<i32>>>,
    go: Mutex<Option<mpsc::Receiver<()>>>,
    /// The body ends its own session with `pg_terminate_backend(pg_backend_pid())`.
    die_in_body: bool,
}

impl Risky {
    fn new(id: &str) -> Self {
        Risky {
            message_id: id.into(),
            pid: Mutex::new(None),
            go: Mutex::new(None),
            die_in_body: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum ShopError {
    #[error("database error in the handler")]
    Db(#[from] sqlx::Error),
}

#[idempotent(key = "message_id", consumer = "risky")]
async fn risky(tx: &mut sqlx::PgConnection, msg: &Risky) -> Result<(), ShopError> {
    sqlx::query("INSERT INTO effects (consumer, label) VALUES ('risky', $1)")
        .bind(&msg.message_id)
        .execute(&mut *tx)
        .await?;
    if msg.die_in_body {
        sqlx::query("SELECT pg_terminate_backend(pg_backend_pid())")
            .execute(&mut *tx)
            .await?;
    }
    let pid_sender = msg.pid.lock().unwrap().take();
    if let Some(sender) = pid_sender {
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await?;
        sender.send(pid).unwrap();
        let go = msg.go.lock().unwrap().take();
        go.expect("a go-ahead channel").recv().await;
    }
    Ok(())
}

#[tokio::test]
async fn connection_that_dies_in_the_body_commits_nothing_and_is_retryable() {
    let h = PgHarness::new().await;
    let mut msg = Risky::new("dies-in-body");
    msg.die_in_body = true;
    let error = risky(&h.inbox, &msg).await.unwrap_err();
    // The handler's own error type says nothing of retries; the outcome does.
    let Error::Transient(ShopError::Db(cause)) = &error else {
        panic!("expected the handler's database error as transient, got {error:?}");
    };
    assert!(error.is_retryable());
    assert!(idempotent::is_retryable(cause), "{cause:?}");
    assert_eq!(count(&h, "dies-in-body").await, (0, 0));

    msg.die_in_body = false;
    assert!(risky(&h.inbox, &msg).await.unwrap().is_processed());
    assert_eq!(count(&h, "dies-in-body").await, (1, 1));
}

#[tokio::test]
async fn connection_that_dies_before_the_commit_commits_nothing_and_is_retryable() {
    let h = PgHarness::new().await;
    let msg = Risky::new("dies-before-commit");
    let (pid_tx, pid_rx) = oneshot::channel();
    let (go_tx, go_rx) = mpsc::channel(1);
    *msg.pid.lock().unwrap() = Some(pid_tx);
    *msg.go.lock().unwrap() = Some(go_rx);
    let (outcome, ()) = tokio::join!(risky(&h.inbox, &msg), async {
        let pid = pid_rx.await.unwrap();
        let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(&h.pool)
            .await
            .unwrap();
        assert!(killed);
        go_tx.send(()).await.unwrap();
    });
    let error = outcome.unwrap_err();
    assert!(
        matches!(
            error,
            Error::Inbox(InboxError::Database {
                stage: Stage::Commit,
                ..
            })
        ),
        "{error:?}"
    );
    assert!(error.is_retryable(), "{error:?}");
    assert_eq!(count(&h, "dies-before-commit").await, (0, 0));

    let redelivery = Risky::new("dies-before-commit");
    assert!(risky(&h.inbox, &redelivery).await.unwrap().is_processed());
    assert!(matches!(
        risky(&h.inbox, &redelivery).await.unwrap(),
        Handled::Duplicate { .. }
    ));
    assert_eq!(count(&h, "dies-before-commit").await, (1, 1));
}

#[tokio::test]
async fn exhausted_pool_is_a_retryable_error_before_any_work() {
    let h = PgHarness::new().await;
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_millis(300))
        .connect_with(h.pool.connect_options().as_ref().clone())
        .await
        .unwrap();
    let inbox = Inbox::new(pool.clone());
    let held = pool.acquire().await.unwrap();
    let error = risky(&inbox, &Risky::new("starved")).await.unwrap_err();
    assert!(
        matches!(
            &error,
            Error::Inbox(InboxError::Database {
                stage: Stage::Begin,
                source: sqlx::Error::PoolTimedOut,
                ..
            })
        ),
        "{error:?}"
    );
    assert!(error.is_retryable());
    drop(held);
    assert!(
        risky(&inbox, &Risky::new("starved"))
            .await
            .unwrap()
            .is_processed()
    );
    assert_eq!(count(&h, "starved").await, (1, 1));
}

/// (effects, inbox rows) for a message of the `risky` handler.
async fn count(h: &PgHarness, label: &str) -> (i64, i64) {
    let effects = sqlx::query_scalar("SELECT COUNT(*) FROM effects WHERE label = $1")
        .bind(label)
        .fetch_one(&h.pool)
        .await
        .unwrap();
    let rows = sqlx::query_scalar("SELECT COUNT(*) FROM idempotent_inbox WHERE consumer = 'risky'")
        .fetch_one(&h.pool)
        .await
        .unwrap();
    (effects, rows)
}

/// A message whose fingerprint cannot be computed (serde_json refuses a map with non-string keys)
/// is refused with the fingerprint's own error, before any database work.
#[tokio::test]
async fn a_message_that_cannot_be_fingerprinted_is_refused_before_any_work() {
    use std::collections::BTreeMap;

    #[derive(serde::Serialize)]
    struct Order {
        message_id: String,
        lines: BTreeMap<(u32, u32), u32>,
    }

    #[idempotent(key = "message_id", consumer = "orders", fingerprint)]
    async fn take_order(tx: &mut sqlx::SqliteConnection, msg: &Order) -> Result<(), ShopError> {
        sqlx::query("INSERT INTO effects (consumer, label) VALUES ('orders', $1)")
            .bind(&msg.message_id)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    let h = SqliteHarness::new().await;
    let order = Order {
        message_id: "o-1".into(),
        lines: BTreeMap::from([((1, 2), 3)]),
    };
    let error = take_order(&h.inbox, &order).await.unwrap_err();
    assert!(
        matches!(error, Error::Inbox(InboxError::Fingerprint { .. })),
        "{error:?}"
    );
    assert!(!error.is_retryable());
    assert!(!h.inbox.is_processed("orders", "o-1").await.unwrap());
}
