//! The conformance suite on PostgreSQL (`IDEMPOTENT_PG_URL`), a fresh schema per test: with the
//! claim in a statement of its own (the default), and sent together with its `BEGIN`.
#![cfg(feature = "postgres")]

#[path = "../conformance/mod.rs"]
mod conformance;
#[path = "../support/mod.rs"]
mod support;

use conformance::conformance_tests;
use support::postgres::PgHarness;

conformance_tests!(PgHarness::new().await);

mod pipelined_claim {
    use super::*;

    conformance_tests!(PgHarness::new().await.with_pipelined_claim());
}

/// The pipelined claim is a statement each session prepares once; a session that lost it
/// (`DEALLOCATE`) prepares it again on its next claim, which then goes ahead as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_lost_its_prepared_claim_prepares_it_again() {
    use idempotent::message_key;
    use support::{Consumer, Delivery, Harness};

    let h = PgHarness::new().await.with_pipelined_claim();
    let worker = h.inbox.for_worker();
    let prepared = "SELECT name FROM pg_prepared_statements WHERE name LIKE 'idempotent_claim_%'";
    let first = Delivery::new("before");
    assert!(
        h.deliver_on(&worker, Consumer::Orders, &first)
            .await
            .unwrap()
            .is_processed()
    );
    let mut claimed = worker
        .claim("orders", &message_key("deallocating").unwrap())
        .await
        .unwrap()
        .unwrap();
    let name: String = sqlx::query_scalar(prepared)
        .fetch_one(claimed.connection())
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("DEALLOCATE {name}")))
        .execute(claimed.connection())
        .await
        .unwrap();
    claimed.commit().await.unwrap();

    let after = Delivery::new("after");
    for (msg, processed) in [(&after, true), (&after, false), (&first, false)] {
        let outcome = h.deliver_on(&worker, Consumer::Orders, msg).await.unwrap();
        assert_eq!(outcome.is_processed(), processed, "{outcome:?}");
    }
    let mut claimed = worker
        .claim("orders", &message_key("prepared-again").unwrap())
        .await
        .unwrap()
        .unwrap();
    let names: Vec<String> = sqlx::query_scalar(prepared)
        .fetch_all(claimed.connection())
        .await
        .unwrap();
    assert_eq!(names, [name], "the session prepared the claim again");
    claimed.commit().await.unwrap();
    assert_eq!(h.effects("before").await + h.effects("after").await, 2);
}

/// After a body's `DEALLOCATE ALL`, sqlx's cache of the session's prepared statements is stale.
/// The claim recovers (it forgets the statements and claims again), a body whose statements hit
/// the stale cache gets a retryable outcome, and the worker's one connection keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_deallocates_every_statement_breaks_no_later_claim() {
    use idempotent::{Error, Handled, InboxError};
    use support::{Behaviour, Consumer, Delivery, Harness, Step};

    let h = PgHarness::new().await;
    let worker = h.inbox_of_one().for_worker();
    let deliver = async |msg: &Delivery| h.deliver_on(&worker, Consumer::Orders, msg).await;
    let deallocate = |label: &str, then: &[Step]| {
        let mut steps = vec![Step::Effect("orders"), Step::Sql("DEALLOCATE ALL")];
        steps.extend_from_slice(then);
        Delivery::new(label).behaving(Behaviour::Script(steps))
    };
    // Every statement of a delivery prepared and cached on the one connection.
    assert!(
        deliver(&Delivery::new("warm"))
            .await
            .unwrap()
            .is_processed()
    );

    // The commit's own check is not among the cached statements.
    let outcome = deliver(&deallocate("deallocates", &[])).await;
    assert!(matches!(outcome, Ok(Handled::Processed(()))), "{outcome:?}");
    // The next claim finds its statement gone, forgets the cache and claims again.
    assert!(
        deliver(&Delivery::new("after"))
            .await
            .unwrap()
            .is_processed()
    );

    // A body whose own cached statement is gone: swallowed, the transaction is aborted.
    let error = deliver(&deallocate("then-swallows", &[Step::Effect("orders")]))
        .await
        .unwrap_err();
    assert!(
        matches!(error, Error::Inbox(InboxError::TransactionAborted)),
        "{error:?}"
    );
    assert!(error.is_retryable());
    // The claim after it recovers again.
    assert!(
        deliver(&Delivery::new("recovers"))
            .await
            .unwrap()
            .is_processed()
    );
    for label in ["warm", "deallocates", "after", "recovers"] {
        assert_eq!(h.effects_of("orders", label).await, 1, "{label}");
    }
    assert_eq!(h.effects_of("orders", "then-swallows").await, 0);
    let retry = deliver(&Delivery::new("then-swallows")).await;
    assert!(matches!(retry, Ok(Handled::Processed(()))), "{retry:?}");
}

/// A handler whose body deallocates the session's statements and then runs one of them: its
/// error is transient whatever its type, and the next call on the pool of one gets a fresh
/// connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_statement_that_lost_its_prepared_statement_is_retryable() {
    use idempotent::{Error, idempotent};
    use support::{Consumer, Delivery, Harness, TestError};

    #[idempotent(key = "message_id", consumer = "orders")]
    async fn stale(tx: &mut sqlx::PgConnection, msg: &Delivery) -> Result<(), TestError> {
        use sqlx::Executor;
        tx.execute("DEALLOCATE ALL").await?;
        // The statement the `orders` handler prepared on this connection.
        sqlx::query("INSERT INTO effects (consumer, label) VALUES ($1, $2)")
            .bind("orders")
            .bind(&msg.label)
            .execute(&mut *tx)
            .await?;
        Ok(())
    }

    let h = PgHarness::new().await;
    let inbox = h.inbox_of_one();
    // The effect's statement is prepared and cached on the one connection.
    assert!(
        h.deliver_on(&inbox, Consumer::Orders, &Delivery::new("warm"))
            .await
            .unwrap()
            .is_processed()
    );
    let error = stale(&inbox, &Delivery::new("stale")).await.unwrap_err();
    assert!(
        matches!(error, Error::Transient(TestError::Db(_))),
        "{error:?}"
    );
    assert!(error.is_retryable());
    assert_eq!(h.effects("stale").await, 0);
    // A fresh connection: the same statement is prepared again and the retry goes through.
    let retry = h
        .deliver_on(&inbox, Consumer::Orders, &Delivery::new("stale"))
        .await
        .unwrap();
    assert!(retry.is_processed());
    assert_eq!(h.effects("stale").await, 1);
}

/// A response that cannot be stored says so, at its own stage: here a body that carried on after
/// a failed statement left the transaction aborted, so storing its response fails; retryable,
/// nothing committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_that_cannot_be_stored_fails_at_its_own_stage() {
    use idempotent::{Error, InboxError, Stage};
    use support::{Behaviour, Delivery, Harness, Step};

    let h = PgHarness::new().await;
    let msg = Delivery::new("unstorable").behaving(Behaviour::Script(vec![
        Step::Effect("quotes"),
        Step::Sql("INSERT INTO uniques (id) VALUES (1)"),
    ]));
    let error = h.deliver_quote(&msg).await.unwrap_err();
    assert!(
        matches!(
            error,
            Error::Inbox(InboxError::Database {
                stage: Stage::StoreResponse,
                ..
            })
        ),
        "{error:?}"
    );
    assert!(error.is_retryable());
    assert_eq!(h.effects("unstorable").await, 0);
    assert!(!h.inbox.is_processed("quotes", "unstorable").await.unwrap());
}

/// The claim under SERIALIZABLE, which CockroachDB and YugabyteDB run by default (shown here on
/// PostgreSQL's SERIALIZABLE, not on those databases): copies of one message at the same moment do
/// not all wait and see a duplicate, as under READ COMMITTED. One is processed; a copy that waited
/// for it cannot see its commit in its snapshot, and fails with a serialization failure (40001),
/// which is retryable; every retry is a duplicate. The effect happens once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_copies_under_serializable_fail_retryably_then_are_duplicates() {
    use idempotent::{Error, Handled, InboxError};
    use support::{Consumer, Delivery, Harness};

    let h = PgHarness::new().await;
    let options = h
        .pool
        .connect_options()
        .as_ref()
        .clone()
        .options([("default_transaction_isolation", "serializable")]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(16)
        .connect_with(options)
        .await
        .unwrap();
    let level: String = sqlx::query_scalar("SHOW transaction_isolation")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(level, "serializable");
    let inbox = idempotent::Inbox::new(pool);
    let serialization_failure = |error: &Error<support::TestError>| {
        let Error::Inbox(InboxError::Database { source, .. }) = error else {
            panic!("{error:?}");
        };
        let code = source.as_database_error().and_then(|e| e.code());
        assert_eq!(code.as_deref(), Some("40001"), "{error:?}");
        assert!(error.is_retryable());
    };
    for round in 0..10 {
        let msg = Delivery::new(&format!("serializable-{round}"));
        let outcomes =
            futures::future::join_all((0..8).map(|_| h.deliver_on(&inbox, Consumer::Orders, &msg)))
                .await;
        let mut processed = 0;
        for outcome in outcomes {
            match outcome {
                Ok(Handled::Processed(())) => processed += 1,
                Ok(Handled::Duplicate { .. }) => {}
                Err(error) => {
                    serialization_failure(&error);
                    let retry = h.deliver_on(&inbox, Consumer::Orders, &msg).await.unwrap();
                    assert!(retry.is_duplicate(), "{retry:?}");
                }
            }
        }
        assert_eq!(processed, 1, "{}", msg.label);
        assert_eq!(h.effects(&msg.label).await, 1);
    }

    // A copy that waited for another's commit, made to wait whatever the machine's scheduling (with
    // CPU burners beside it, the copies above may all run one after another): the first claim is
    // held open until the copy waits for it, then committed.
    let msg = Delivery::new("serializable-held");
    let key = idempotent::message_key(&msg.message_id).unwrap();
    let held = inbox
        .claim("orders", &key)
        .await
        .unwrap()
        .expect("a fresh key is claimed");
    let (waited, ()) = tokio::join!(h.deliver_on(&inbox, Consumer::Orders, &msg), async {
        h.wait_until_a_claim_blocks().await;
        held.commit().await.unwrap();
    });
    serialization_failure(&waited.expect_err("the copy that waited saw the commit"));
    let retry = h.deliver_on(&inbox, Consumer::Orders, &msg).await.unwrap();
    assert!(retry.is_duplicate(), "{retry:?}");
    assert_eq!(h.effects("serializable-held").await, 0);
}

/// Relays that sleep between polls (here an hour) are woken by the `NOTIFY` each commit with
/// outgoing messages sends after it, coalesced per inbox: 400 commits from 8 workers at once
/// all reach a listening relay, none left for a poll that does not come; so does a message
/// queued later with `enqueue` in a transaction of the caller's (its `NOTIFY` sent at its commit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_that_only_listen_are_woken_after_every_commit_of_a_burst() {
    use std::time::Duration;

    use conformance::{Recorder, until_drained};
    use idempotent::outbox::{Destination, Outbox, OutgoingMessage, RelayOptions};
    use support::{Delivery, Harness, Outgoing};

    let h = PgHarness::new().await;
    let recorder = Recorder::new(Duration::ZERO);
    let hour = Duration::from_secs(3600);
    let relay = h.inbox().spawn_relay(
        recorder.clone(),
        RelayOptions::default().poll_interval(hour, hour),
    );
    for round in 0..2 {
        let workers = (0..8).map(|worker| {
            let h = &h;
            async move {
                for i in 0..25 {
                    let msg = Delivery::new(&format!("r{round}-w{worker}-m{i}"))
                        .sending(Outgoing::default());
                    assert!(h.deliver_notifier(&msg).await.unwrap().is_processed());
                }
            }
        });
        futures::future::join_all(workers).await;
        until_drained(&h).await;
        // Idle for a while: the relay sleeps.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let mut tx = h.inbox().pool().begin().await.unwrap();
    let mut outbox = Outbox::new("checkout", "order-1").unwrap();
    outbox.send(OutgoingMessage::new(Destination::queue("q"), b"x".to_vec()));
    h.inbox().enqueue(&mut tx, outbox).await.unwrap();
    tx.commit().await.unwrap();
    until_drained(&h).await;
    let stats = relay.shutdown().await;
    assert_eq!(stats.published, 401);
    assert_eq!(recorder.counts().len(), 401);
}

/// A purge of a fifth of an inbox never crosses autovacuum's default threshold (a fifth of the
/// table dead), so without a `VACUUM` the space of the rows it deleted is not reused and the next
/// inserts go to new pages: the table grows by every purge. The purge vacuums what it deleted
/// from: rows inserted after it fit in the space it freed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_space_a_purge_frees_is_reused_by_the_next_inserts() {
    // A database of its own: a `VACUUM` frees no row that a transaction of its database may still
    // see, and the other tests' transactions are in theirs.
    let options: sqlx::postgres::PgConnectOptions =
        support::postgres::url().parse().expect("IDEMPOTENT_PG_URL");
    let database = format!("purge_space_{}", uuid::Uuid::new_v4().simple());
    let admin = sqlx::PgPool::connect_with(options.clone()).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&admin)
        .await
        .unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options.database(&database))
        .await
        .unwrap();
    let inbox = idempotent::Inbox::new(pool.clone());
    inbox.migrate().await.unwrap();
    let size = async || -> i64 {
        sqlx::query_scalar("SELECT pg_relation_size('idempotent_inbox')")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let insert = async |from: i64, age: &str| {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO idempotent_inbox (consumer, message_key, processed_at)
             SELECT 'other', int8send(g), now() - interval '{age}'
             FROM generate_series($1, $1 + 19999) g"
        )))
        .bind(from)
        .execute(&pool)
        .await
        .unwrap();
    };
    insert(0, "30 days").await;
    let filled = size().await;
    let report = inbox.purge_expired(1000).await.unwrap();
    assert_eq!(report.deleted, 20_000);
    insert(1_000_000, "0 days").await;
    let after = size().await;
    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {database} WITH (FORCE)"
    )))
    .execute(&admin)
    .await
    .unwrap();
    assert!(
        after <= filled + filled / 10,
        "the table grew from {filled} to {after} bytes: the purged rows' space was not reused"
    );
}
