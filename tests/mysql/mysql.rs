//! The conformance suite on MySQL or MariaDB (`IDEMPOTENT_MYSQL_URL`), a fresh database per test.
#![cfg(feature = "mysql")]

#[path = "../conformance/mod.rs"]
mod conformance;
#[path = "../support/mod.rs"]
mod support;

use conformance::conformance_tests;
use support::mysql::MySqlHarness;

conformance_tests!(MySqlHarness::new().await);

use std::sync::Mutex;
use std::time::Duration;

use idempotent::{Error, Handled, InboxError, idempotent};
use sqlx::MySqlConnection;
use support::{Behaviour, Consumer, Delivery, Harness, Step};
use tokio::sync::oneshot;

#[derive(Debug, thiserror::Error)]
enum ShopError {
    #[error("database error in the handler")]
    Db(#[from] sqlx::Error),
}

/// A transfer whose body can be made to deadlock with another transaction: it locks account 1,
/// says so, waits for the go-ahead, then asks for account 2.
struct Transfer {
    id: String,
    /// Carry on after a failed statement, as a best-effort body would.
    swallow: bool,
    locked: Mutex<Option<oneshot::Sender<()>>>,
    go: Mutex<Option<oneshot::Receiver<()>>>,
}

impl Transfer {
    fn new(id: &str, swallow: bool) -> Self {
        Self {
            id: id.into(),
            swallow,
            locked: Mutex::new(None),
            go: Mutex::new(None),
        }
    }
}

#[idempotent(key = "id", consumer = "transfers")]
async fn transfer(tx: &mut MySqlConnection, msg: &Transfer) -> Result<(), ShopError> {
    sqlx::query("UPDATE accounts SET n = n + 1 WHERE id = 1")
        .execute(&mut *tx)
        .await?;
    let locked = msg.locked.lock().unwrap().take();
    if let Some(locked) = locked {
        locked.send(()).unwrap();
        let go = msg.go.lock().unwrap().take();
        go.expect("a go-ahead").await.unwrap();
    }
    let second = sqlx::query("UPDATE accounts SET n = n + 1 WHERE id = 2")
        .execute(&mut *tx)
        .await;
    if !msg.swallow {
        second?;
    }
    let effect = sqlx::query("INSERT INTO effects (consumer, label) VALUES ('transfers', ?)")
        .bind(&msg.id)
        .execute(&mut *tx)
        .await;
    if !msg.swallow {
        effect?;
    }
    Ok(())
}

/// Runs `msg` into a deadlock with a heavier transaction, which InnoDB keeps: the body's
/// transaction is the one rolled back (error 1213), in the middle of the body.
async fn deliver_into_a_deadlock(
    h: &MySqlHarness,
    msg: Transfer,
) -> Result<Handled<()>, Error<ShopError>> {
    let (locked_tx, locked_rx) = oneshot::channel();
    let (go_tx, go_rx) = oneshot::channel();
    *msg.locked.lock().unwrap() = Some(locked_tx);
    *msg.go.lock().unwrap() = Some(go_rx);
    let mut other = h.pool.begin().await.unwrap();
    // Heavier than the body's transaction, so that InnoDB picks the body's as the victim.
    sqlx::query("INSERT INTO ballast (x) SELECT seq FROM seq_1_to_500")
        .execute(&mut *other)
        .await
        .unwrap();
    sqlx::query("UPDATE accounts SET n = n + 1 WHERE id = 2")
        .execute(&mut *other)
        .await
        .unwrap();
    let (outcome, ()) = tokio::join!(transfer(&h.inbox, &msg), async {
        locked_rx.await.unwrap();
        let (waited, ()) = tokio::join!(
            sqlx::query("UPDATE accounts SET n = n + 1 WHERE id = 1").execute(&mut *other),
            async {
                // Let the other transaction's update start waiting for the body's lock.
                tokio::time::sleep(Duration::from_millis(300)).await;
                go_tx.send(()).unwrap();
            }
        );
        waited.expect("InnoDB rolled back the heavier transaction");
    });
    other.commit().await.unwrap();
    outcome
}

async fn deadlock_harness() -> MySqlHarness {
    let h = MySqlHarness::new().await;
    for statement in [
        "CREATE TABLE accounts (id INT PRIMARY KEY, n INT NOT NULL) ENGINE = InnoDB",
        "INSERT INTO accounts (id, n) VALUES (1, 0), (2, 0)",
        "CREATE TABLE ballast (x INT) ENGINE = InnoDB",
    ] {
        sqlx::query(statement).execute(&h.pool).await.unwrap();
    }
    h
}

/// (effects, inbox rows) of a transfer.
async fn transfer_counts(h: &MySqlHarness, id: &str) -> (i64, bool) {
    let effects = h.effects_of("transfers", id).await;
    (
        effects,
        h.inbox.is_processed("transfers", id).await.unwrap(),
    )
}

/// A deadlock in the body (InnoDB rolls the whole transaction back; on Galera a brute-force abort
/// or a certification conflict gives the same error) reaches the caller as `Error::Transient`,
/// retryable, whatever the handler's error type: nothing is committed and the retry succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_in_the_body_is_retryable_whatever_the_error_type() {
    let h = deadlock_harness().await;
    let outcome = deliver_into_a_deadlock(&h, Transfer::new("t-1", false)).await;
    let error = outcome.unwrap_err();
    assert!(
        matches!(&error, Error::Transient(ShopError::Db(_))),
        "{error:?}"
    );
    assert!(error.is_retryable());
    assert_eq!(transfer_counts(&h, "t-1").await, (0, false));
    let retry = transfer(&h.inbox, &Transfer::new("t-1", false)).await;
    assert!(matches!(retry, Ok(Handled::Processed(()))), "{retry:?}");
    assert_eq!(transfer_counts(&h, "t-1").await, (1, true));
}

/// A body that ignores the deadlock and writes on: its writes after the rollback would commit one
/// by one in autocommit mode, without the key, and the redelivery would write them again. They are
/// refused instead (the session is read-only around the inbox's transaction), and the inbox reports
/// the transaction as ended with nothing committed, retryable; the retry processes it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_the_body_ignores_commits_nothing_and_is_retryable() {
    let h = deadlock_harness().await;
    let outcome = deliver_into_a_deadlock(&h, Transfer::new("t-2", true)).await;
    let error = outcome.unwrap_err();
    assert!(
        matches!(
            error,
            Error::Inbox(InboxError::TransactionEnded {
                key_committed: false,
                later_writes_refused: true
            })
        ),
        "{error:?}"
    );
    assert!(error.is_retryable());
    assert_eq!(transfer_counts(&h, "t-2").await, (0, false));
    let retry = transfer(&h.inbox, &Transfer::new("t-2", true)).await;
    assert!(matches!(retry, Ok(Handled::Processed(()))), "{retry:?}");
    assert_eq!(transfer_counts(&h, "t-2").await, (1, true));
    let accounts: Vec<i32> = sqlx::query_scalar("SELECT n FROM accounts ORDER BY id")
        .fetch_all(&h.pool)
        .await
        .unwrap();
    assert_eq!(
        accounts,
        [2, 2],
        "the other transaction's and the retry's updates"
    );
}

/// Statements that commit implicitly (`BEGIN`, DDL, `TRUNCATE`) commit the claim and the work
/// before them: the call says so (the key is committed, a redelivery is a duplicate), and the
/// writes after them are refused rather than committed on their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_that_commits_implicitly_is_reported_with_the_key_committed() {
    let h = MySqlHarness::new().await;
    sqlx::query("CREATE TABLE scratch (x INT)")
        .execute(&h.pool)
        .await
        .unwrap();
    for (label, sql) in [
        (
            "implicit-create",
            "CREATE TABLE IF NOT EXISTS scratch (x INT)",
        ),
        ("implicit-begin", "BEGIN"),
        ("implicit-truncate", "TRUNCATE TABLE scratch"),
    ] {
        let msg = Delivery::new(label).behaving(Behaviour::Script(vec![
            Step::Effect("before"),
            Step::Sql(sql),
            Step::Effect("after"),
        ]));
        let error = h.deliver(Consumer::Orders, &msg).await.unwrap_err();
        assert!(
            matches!(
                error,
                Error::Inbox(InboxError::TransactionEnded {
                    key_committed: true,
                    later_writes_refused: true
                })
            ),
            "{label}: {error:?}"
        );
        assert!(!error.is_retryable(), "{label}");
        assert_eq!(h.effects_of("before", label).await, 1, "{label}");
        assert_eq!(h.effects_of("after", label).await, 0, "{label}");
        let retry = h.deliver(Consumer::Orders, &Delivery::new(label)).await;
        assert!(
            matches!(retry, Ok(Handled::Duplicate { .. })),
            "{label}: {retry:?}"
        );
    }
}

/// How many index entries a relay batch reads on MySQL and MariaDB, counted with the session's
/// handler reads on a pool of one connection that the relay and the count share: a batch reads
/// about what it takes, not every pending row, nor the sent rows kept before them.
mod relay_reads {
    use std::time::Duration;

    use idempotent::Inbox;
    use idempotent::outbox::{Destination, Outbox, OutgoingMessage, RelayOptions};
    use sqlx::MySql;
    use sqlx::mysql::{MySqlPool, MySqlPoolOptions};

    use super::MySqlHarness;
    use crate::conformance::Recorder;
    use crate::support::Harness;

    /// An inbox of the harness's database on a pool of one connection, and that pool.
    async fn on_one_connection(h: &MySqlHarness) -> (Inbox<MySql>, MySqlPool) {
        let options = h.inbox().pool().connect_options().as_ref().clone();
        let one = MySqlPoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .unwrap();
        (Inbox::new(one.clone()), one)
    }

    /// `rounds` transactions of 50 messages, one for each of 50 keys (or none).
    async fn write(inbox: &Inbox<MySql>, rounds: u32, keyed: bool) {
        for n in 0..rounds {
            let mut outbox = Outbox::new("checkout", format!("round-{n}").as_str()).unwrap();
            for key in 0..50 {
                let message = OutgoingMessage::new(Destination::queue("orders"), format!("{n}"));
                outbox.send(if keyed {
                    message.with_ordering_key(format!("key-{key}"))
                } else {
                    message
                });
            }
            let mut tx = inbox.pool().begin().await.unwrap();
            inbox.enqueue(&mut tx, outbox).await.unwrap();
            tx.commit().await.unwrap();
        }
    }

    /// The index entries the pool's one session has read so far.
    async fn index_reads(pool: &MySqlPool) -> i64 {
        let rows: Vec<(String, String)> =
            sqlx::query_as("SHOW SESSION STATUS LIKE 'Handler_read%'")
                .fetch_all(pool)
                .await
                .unwrap();
        rows.iter().map(|(_, n)| n.parse::<i64>().unwrap()).sum()
    }

    /// Brings the outbox's statistics up to date, as InnoDB's own upkeep would, so that what a
    /// batch reads does not depend on when that upkeep ran.
    async fn analyze(pool: &MySqlPool) {
        sqlx::query("ANALYZE TABLE idempotent_inbox_outbox")
            .execute(pool)
            .await
            .unwrap();
    }

    /// One relay batch of 100 on `inbox`: the entries it read.
    async fn batch_reads(inbox: &Inbox<MySql>, pool: &MySqlPool) -> i64 {
        let recorder = Recorder::new(Duration::ZERO);
        let before = index_reads(pool).await;
        let options = RelayOptions::default().batch_size(100);
        let report = inbox.relay_once(&recorder, &options).await.unwrap();
        assert_eq!(report.published, 100, "{report:?}");
        index_reads(pool).await - before
    }

    /// Runs one relay batch of 100, and checks that it read fewer than 2,500 index entries, where
    /// reading through the rows it is `among` reads 5,000 or more.
    async fn assert_a_batch_reads_little(inbox: &Inbox<MySql>, pool: &MySqlPool, among: &str) {
        let read = batch_reads(inbox, pool).await;
        assert!(read < 2_500, "{read} index entries read for {among}");
    }

    /// The keys' heads, found one index entry a key (the loose index scan), also on a connection
    /// that ran the relay before its table was emptied by `TRUNCATE`: MariaDB prepares a statement
    /// again after a `TRUNCATE` of its table without that scan, and the heads' prepared statement
    /// then read every pending row at each batch for as long as the connection lived.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_keyed_batch_reads_its_keys_not_every_pending_row_even_after_a_truncate() {
        let h = MySqlHarness::new().await;
        let (inbox, one) = on_one_connection(&h).await;
        write(&inbox, 100, true).await;
        batch_reads(&inbox, &one).await;
        for table in ["idempotent_inbox_outbox", "idempotent_inbox_outbox_keys"] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("TRUNCATE TABLE {table}")))
                .execute(&one)
                .await
                .unwrap();
        }
        write(&inbox, 100, true).await;
        // Up to date: MariaDB's re-prepared statement kept its full scan after an `ANALYZE`.
        analyze(&one).await;
        // Some hundreds (857 on MariaDB 10.11); every pending row is 5,000.
        assert_a_batch_reads_little(&inbox, &one, "100 of 5,000 pending rows").await;
    }

    /// The keys' runs, read by their ranges of the index also on statistics taken while the
    /// table was empty, which InnoDB keeps until its upkeep catches up (here: never, its
    /// recalculation turned off). On those, MariaDB read the runs through the `(state, sent_at)`
    /// index: every pending row at each batch.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_keyed_batch_reads_its_keys_runs_on_the_statistics_of_an_empty_table() {
        let h = MySqlHarness::new().await;
        let (inbox, one) = on_one_connection(&h).await;
        sqlx::query("ALTER TABLE idempotent_inbox_outbox STATS_AUTO_RECALC = 0")
            .execute(&one)
            .await
            .unwrap();
        analyze(&one).await;
        write(&inbox, 100, true).await;
        // Some hundreds (857 on MariaDB 10.11); through `(state, sent_at)`, 5,608.
        assert_a_batch_reads_little(&inbox, &one, "100 of 5,000 pending rows").await;
    }

    /// Rows without a key, read in id order from the first pending one: neither the sent rows
    /// the outbox keeps before them (until its retention ends) are read again at each batch, as
    /// they were when MariaDB read the table in id order from its start, nor every pending row
    /// to sort them by id, as they were when it read them by state and key alone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unkeyed_batch_reads_neither_the_sent_rows_before_it_nor_every_pending_row() {
        let h = MySqlHarness::new().await;
        let (inbox, one) = on_one_connection(&h).await;
        write(&inbox, 100, false).await;
        for _ in 0..50 {
            batch_reads(&inbox, &one).await;
        }
        write(&inbox, 2, false).await;
        analyze(&one).await;
        // Some hundreds (205 on MariaDB 10.11); the sent rows before them are 5,000.
        assert_a_batch_reads_little(&inbox, &one, "100 rows after 5,000 sent ones").await;
        write(&inbox, 100, false).await;
        analyze(&one).await;
        let among = "100 of 5,000 pending rows after 5,100 sent ones";
        assert_a_batch_reads_little(&inbox, &one, among).await;
    }
}
