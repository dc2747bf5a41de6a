//! Callers and bodies that misbehave: a body that swallows a failed statement or ends the
//! transaction itself, a handler future dropped at every await point on a pool of one, a worker's
//! inbox whose pool has one connection, names and leases that cannot be stored.

use std::task::Poll;
use std::time::Duration;

use idempotent::{Error, Handled, Inbox, InboxError, message_key};

use crate::support::{Behaviour, Consumer, Delivery, Harness, Step};

/// How long a call may take before the test calls it hung (a stranded connection, a stall).
const HANG: Duration = Duration::from_secs(20);

/// A body that swallows a failed statement and returns `Ok`: either the inbox commits its work and
/// the key together (MySQL, SQLite: the transaction survives a failed statement), or, where the
/// database aborted the transaction (PostgreSQL), the inbox reports it, retryable, with nothing
/// committed. Never `Processed` with nothing committed.
pub async fn body_that_swallows_a_failed_statement_is_never_processed_without_its_commit(
    h: impl Harness,
) {
    let msg = Delivery::new("swallows").behaving(Behaviour::Script(vec![
        Step::Effect("orders"),
        Step::Sql("INSERT INTO uniques (id) VALUES (1)"), // a unique violation, ignored
        Step::Effect("orders-after"),
    ]));
    let committed = match h.deliver(Consumer::Orders, &msg).await {
        Ok(Handled::Processed(())) => true,
        Err(Error::Inbox(InboxError::TransactionAborted)) => false,
        other => panic!("expected Processed or TransactionAborted, got {other:?}"),
    };
    let expected = i64::from(committed);
    assert_eq!(h.effects_of("orders", "swallows").await, expected);
    assert_eq!(h.effects_of("orders-after", "swallows").await, expected);
    assert_eq!(
        h.inbox().is_processed("orders", "swallows").await.unwrap(),
        committed
    );
    if !committed {
        let error = h.deliver(Consumer::Orders, &msg).await.unwrap_err();
        assert!(error.is_retryable(), "{error:?}");
        let redelivery = Delivery::new("swallows");
        let outcome = h.deliver(Consumer::Orders, &redelivery).await;
        assert!(matches!(outcome, Ok(Handled::Processed(()))), "{outcome:?}");
        assert_eq!(h.effects_of("orders", "swallows").await, 1);
    }

    // Inside a nested transaction (a savepoint) the same failure is the body's to handle, and the
    // message is processed.
    let nested = Delivery::new("swallows-nested").behaving(Behaviour::Script(vec![
        Step::Effect("orders"),
        Step::Sql("SAVEPOINT body"),
        Step::Sql("INSERT INTO uniques (id) VALUES (1)"),
        Step::Sql("ROLLBACK TO SAVEPOINT body"),
        Step::Effect("orders-after"),
    ]));
    let outcome = h.deliver(Consumer::Orders, &nested).await;
    assert!(matches!(outcome, Ok(Handled::Processed(()))), "{outcome:?}");
    assert_eq!(h.effects_of("orders-after", "swallows-nested").await, 1);
    assert!(
        h.inbox()
            .is_processed("orders", "swallows-nested")
            .await
            .unwrap()
    );
}

/// A body that ends the inbox's transaction itself (`ROLLBACK`, `COMMIT`, `COMMIT` then `BEGIN`)
/// and writes on: never `Processed`; the error says whether the key was committed (then with the
/// work before the end, and a redelivery is a duplicate) and whether the writes after the end
/// were refused (MySQL, SQLite) or may have committed on their own (PostgreSQL).
pub async fn body_that_ends_the_transaction_is_never_reported_processed(h: impl Harness) {
    let endings: [(&str, &[&'static str]); 3] = [
        ("ends-rollback", &["ROLLBACK"]),
        ("ends-commit", &["COMMIT"]),
        ("ends-commit-begin", &["COMMIT", "BEGIN"]),
    ];
    for (label, end) in endings {
        let mut steps = vec![Step::Effect("before")];
        steps.extend(end.iter().map(|sql| Step::Sql(sql)));
        steps.push(Step::Effect("after"));
        let msg = Delivery::new(label).behaving(Behaviour::Script(steps));
        let (key_committed, refused) = match h.deliver(Consumer::Orders, &msg).await {
            Err(Error::Inbox(InboxError::TransactionEnded {
                key_committed,
                later_writes_refused,
            })) => (key_committed, later_writes_refused),
            other => panic!("{label}: expected TransactionEnded, got {other:?}"),
        };
        let processed = h.inbox().is_processed("orders", label).await.unwrap();
        assert_eq!(key_committed, processed, "{label}");
        // What the body did before the end commits with the key, or not at all.
        assert_eq!(
            h.effects_of("before", label).await,
            i64::from(key_committed),
            "{label}"
        );
        let after = h.effects_of("after", label).await;
        if refused {
            assert_eq!(
                after, 0,
                "{label}: a write after the end committed on its own"
            );
        } else {
            assert!(after <= 1, "{label}");
        }
        let retry = h.deliver(Consumer::Orders, &Delivery::new(label)).await;
        match retry {
            Ok(Handled::Duplicate { .. }) => assert!(key_committed, "{label}"),
            Ok(Handled::Processed(())) => assert!(!key_committed, "{label}"),
            other => panic!("{label}: the redelivery failed: {other:?}"),
        }
        assert!(h.inbox().is_processed("orders", label).await.unwrap());
    }
}

/// A body that runs a statement that may end the transaction (`ROLLBACK`, `COMMIT`, `BEGIN`,
/// `START TRANSACTION`, `SET autocommit = 1`: each backend ends it on some of them, and ignores or
/// refuses the others), writes on, and then returns `Ok` or its own error: whatever the outcome,
/// it tells the truth about what was committed. `Processed` only with the whole effect and the key;
/// the handler's own error (or a retryable one) only with nothing committed, so that the retry runs
/// the body once more; otherwise `TransactionEnded`, whose `key_committed` says what a redelivery
/// will find. On the error path as on the success path.
pub async fn body_that_ends_the_transaction_is_reported_truthfully_on_every_path(h: impl Harness) {
    let endings: [(&str, &[&'static str]); 7] = [
        ("rollback", &["ROLLBACK"]),
        ("commit", &["COMMIT"]),
        ("commit-begin", &["COMMIT", "BEGIN"]),
        // A statement that fails in the transaction the body began: on PostgreSQL it aborts that
        // one, which then cannot say whose it was.
        (
            "commit-begin-fail",
            &["COMMIT", "BEGIN", "INSERT INTO uniques (id) VALUES (1)"],
        ),
        ("begin", &["BEGIN"]),
        ("start", &["START TRANSACTION"]),
        ("autocommit", &["SET autocommit = 1"]),
    ];
    for (ending, end) in endings {
        for fails in [false, true] {
            let label = format!("truth-{ending}-{}", if fails { "err" } else { "ok" });
            let mut steps = vec![Step::Effect("before")];
            steps.extend(end.iter().map(|sql| Step::Sql(sql)));
            steps.push(Step::Effect("after"));
            if fails {
                steps.push(Step::Fail);
            }
            let msg = Delivery::new(&label).behaving(Behaviour::Script(steps));
            let outcome = h.deliver(Consumer::Orders, &msg).await;
            let processed = h.inbox().is_processed("orders", &label).await.unwrap();
            let before = h.effects_of("before", &label).await;
            let after = h.effects_of("after", &label).await;
            let facts = format!(
                "{label}: {outcome:?}; key committed: {processed}, effects before/after the end: {before}/{after}"
            );
            let key_committed = match outcome {
                Ok(Handled::Processed(())) => {
                    assert!(!fails, "{facts}: a failed body reported processed");
                    assert!(processed && before == 1 && after == 1, "{facts}");
                    true
                }
                Err(Error::Inbox(InboxError::TransactionEnded {
                    key_committed,
                    later_writes_refused,
                })) => {
                    assert_eq!(key_committed, processed, "{facts}");
                    assert_eq!(before, i64::from(key_committed), "{facts}");
                    if later_writes_refused {
                        assert_eq!(after, 0, "{facts}");
                    }
                    key_committed
                }
                Err(Error::Inbox(InboxError::TransactionAborted))
                | Err(Error::Handler(_))
                | Err(Error::Transient(_)) => {
                    // A plain failure: nothing may have been committed, so that the retry reruns
                    // the whole body.
                    assert!(!processed && before == 0 && after == 0, "{facts}");
                    false
                }
                Ok(Handled::Duplicate { .. }) | Err(_) => panic!("{facts}"),
            };
            let retry = h.deliver(Consumer::Orders, &Delivery::new(&label)).await;
            match retry {
                Ok(Handled::Duplicate { .. }) => assert!(key_committed, "{facts}"),
                Ok(Handled::Processed(())) => assert!(!key_committed, "{facts}"),
                other => panic!("{facts}: the redelivery failed: {other:?}"),
            }
        }
    }
}

/// A body that ends the inbox's transaction itself and then panics, on a pool of one connection:
/// the connection the panic leaves behind serves the next message, whose body runs and commits.
pub async fn body_that_ends_the_transaction_and_panics_leaves_a_pool_of_one_working(
    h: impl Harness,
) {
    let inbox = h.inbox_with_pool(1);
    let endings: [(&str, &[&'static str]); 4] = [
        ("panics-rollback", &["ROLLBACK"]),
        ("panics-commit", &["COMMIT"]),
        ("panics-commit-begin", &["COMMIT", "BEGIN"]),
        ("panics-begin", &["BEGIN"]),
    ];
    for (label, end) in endings {
        let mut steps = vec![Step::Effect("before")];
        steps.extend(end.iter().map(|sql| Step::Sql(sql)));
        steps.push(Step::Effect("after"));
        steps.push(Step::Panic);
        let msg = Delivery::new(label).behaving(Behaviour::Script(steps));
        let panicked = std::panic::AssertUnwindSafe(h.deliver_on(&inbox, Consumer::Orders, &msg));
        let panicked = tokio::time::timeout(HANG, futures::FutureExt::catch_unwind(panicked))
            .await
            .unwrap_or_else(|_| panic!("{label}: the panicking call hung"));
        assert!(
            panicked.is_err(),
            "{label}: the panic did not reach the caller"
        );
        let next = Delivery::new(&format!("{label}-next"));
        let outcome = tokio::time::timeout(HANG, h.deliver_on(&inbox, Consumer::Orders, &next))
            .await
            .unwrap_or_else(|_| panic!("{label}: the next message hung"));
        assert!(
            matches!(outcome, Ok(Handled::Processed(()))),
            "{label}: the next message on the pool's one connection: {outcome:?}"
        );
        assert_eq!(h.effects(&format!("{label}-next")).await, 1, "{label}");
    }
}

/// Polls `future` until it is ready, or drops it at its `n`th poll that returns `Pending`: its
/// output, or `None` when it was dropped.
pub async fn run_until_pending<F: std::future::Future>(future: F, n: usize) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    for _ in 1..n {
        match futures::poll!(future.as_mut()) {
            Poll::Ready(output) => return Some(output),
            // Not a sleep: a sleep lets the server's answers arrive, and the next poll then runs
            // through several await points at once, leaving them uncovered (on a fast machine the
            // whole call could finish in two polls).
            Poll::Pending => tokio::task::yield_now().await,
        }
    }
    match futures::poll!(future.as_mut()) {
        Poll::Ready(output) => Some(output),
        Poll::Pending => None,
    }
}

/// A handler future dropped after each of its first `n` polls that returned `Pending` (so at every
/// await point of the claim, the body's statements and the commit), on an inbox whose pool has one
/// connection: the connection is never handed back in an unknown state, so the next delivery on
/// that pool goes through, and each message has its effect exactly once.
pub async fn handler_dropped_at_every_await_point_leaves_a_pool_of_one_working(h: impl Harness) {
    let inbox = h.inbox_of_one();
    sweep_until_several_drops(async |sweep| drop_at_every_await_point(&h, &inbox, sweep).await)
        .await;
}

/// Runs `sweep` (a sweep of drops at every await point, numbered from 1, returning how many drops
/// it made) until one sweep made several, at most 10 times; returns how many calls the sweeps
/// made in all (each sweep's drops and its last call, which ran to its end). A poll runs through
/// as many await points as the server has answered by then: on a machine whose threads are
/// descheduled for long (other work beside the tests), a sweep may meet fewer `Pending`s. Every
/// sweep checks the same.
pub async fn sweep_until_several_drops(mut sweep: impl AsyncFnMut(usize) -> usize) -> usize {
    let (mut calls, mut most) = (0, 0);
    for number in 1..=10 {
        let drops = sweep(number).await;
        calls += drops + 1;
        most = most.max(drops);
        if most >= 2 {
            break;
        }
    }
    assert!(
        most >= 2,
        "the handler had at most {most} await points in 10 sweeps"
    );
    calls
}

/// One sweep of [`handler_dropped_at_every_await_point_leaves_a_pool_of_one_working`]: how many
/// times the handler was dropped before a call ran to its end.
async fn drop_at_every_await_point<H: Harness>(h: &H, inbox: &Inbox<H::Db>, sweep: usize) -> usize {
    let mut drops = 0;
    for n in 1.. {
        let msg = Delivery::new(&format!("dropped-{sweep}-{n}"));
        let finished = run_until_pending(h.deliver_on(inbox, Consumer::Savepoints, &msg), n).await;
        let outcome = tokio::time::timeout(HANG, h.deliver_on(inbox, Consumer::Savepoints, &msg))
            .await
            .unwrap_or_else(|_| panic!("after a drop at await point {n}, the pool of one hung"))
            .unwrap_or_else(|error| panic!("after a drop at await point {n}: {error:?}"));
        if finished.is_some() {
            assert!(outcome.is_duplicate(), "{outcome:?}");
        }
        assert_eq!(h.effects_of("savepoints", &msg.label).await, 1, "{n}");
        assert_eq!(h.effects_of("savepoint-kept", &msg.label).await, 1, "{n}");
        if let Some(outcome) = finished {
            // Not dropped any more: every await point has been covered.
            assert!(outcome.unwrap().is_processed());
            break;
        }
        drops += 1;
    }
    drops
}

/// A worker's inbox on a pool of one connection: what a duplicate reads (a stored response, a
/// fingerprint) and `is_processed` use the connection the worker keeps, not a second one.
pub async fn worker_inbox_on_a_pool_of_one_reads_on_its_own_connection(h: impl Harness) {
    let worker = h.inbox_of_one().for_worker();
    let quote = Delivery::new("worker-quote");
    let payment = Delivery::new("worker-payment");
    let reads = async {
        let first = h.deliver_quote_on(&worker, &quote).await.unwrap();
        assert_eq!(first, Handled::Processed("quote for worker-quote".into()));
        let again = h.deliver_quote_on(&worker, &quote).await.unwrap();
        assert_eq!(again.value().as_deref(), Some("quote for worker-quote"));
        assert!(
            h.deliver_payment_on(&worker, &payment)
                .await
                .unwrap()
                .is_processed()
        );
        assert!(
            h.deliver_payment_on(&worker, &payment)
                .await
                .unwrap()
                .is_duplicate()
        );
        let other = Delivery::new("worker-payment-changed").with_id("worker-payment");
        let mismatch = h.deliver_payment_on(&worker, &other).await.unwrap_err();
        assert!(
            matches!(
                mismatch,
                Error::Inbox(InboxError::FingerprintMismatch { .. })
            ),
            "{mismatch:?}"
        );
        assert!(worker.is_processed("quotes", "worker-quote").await.unwrap());
        assert!(!worker.is_processed("quotes", "never-sent").await.unwrap());
    };
    tokio::time::timeout(HANG, reads)
        .await
        .expect("a worker's read waited for a second connection");
}

/// Names and leases that no database can take are refused with typed errors before any work.
pub async fn bad_names_and_leases_are_refused_before_any_database_work(h: impl Harness) {
    let inbox = h.inbox();
    let key = message_key("bad-input").unwrap();
    for name in ["", "with\0nul", &"c".repeat(201)] {
        let error = inbox.claim(name, &key).await.unwrap_err();
        assert!(
            matches!(&error, InboxError::ConsumerName { name: n, .. } if n == name),
            "{error:?}"
        );
        assert!(!error.is_retryable());
        let error = inbox.is_processed(name, &key).await.unwrap_err();
        assert!(
            matches!(error, InboxError::ConsumerName { .. }),
            "{error:?}"
        );
        let error = inbox
            .begin_call::<String>("orders", &key, name, Duration::from_secs(1))
            .await
            .unwrap_err();
        assert!(matches!(error, InboxError::CallName { .. }), "{error:?}");
    }
    for lease in [
        Duration::ZERO,
        Duration::MAX,
        Duration::from_secs(400 * 24 * 3600),
    ] {
        let error = inbox
            .begin_call::<String>("orders", &key, "charge", lease)
            .await
            .unwrap_err();
        assert!(
            matches!(error, InboxError::Lease { .. }),
            "{lease:?}: {error:?}"
        );
    }
    assert_eq!(h.inbox_rows().await, 0);
    // The longest lease accepted is stored and read back as it was.
    let lease = idempotent::calls::MAX_CALL_LEASE;
    let idempotent::CallStart::Run(first) = inbox
        .begin_call::<String>("orders", &key, "charge", lease)
        .await
        .unwrap()
    else {
        panic!("a new call was not ours to run");
    };
    let error = inbox
        .begin_call::<String>("orders", &key, "charge", lease)
        .await
        .unwrap_err();
    match error {
        InboxError::CallInProgress { retry_after } => {
            assert!(
                retry_after > lease - Duration::from_secs(60),
                "{retry_after:?}"
            )
        }
        other => panic!("expected the call in progress, got {other:?}"),
    }
    inbox
        .complete_call(first, &"done".to_owned())
        .await
        .unwrap();
}

/// Completing a call again with the same lease is a success when the result is the same (a retry
/// after a lost answer) and says so when it differs; only a later attempt's takeover is `Fenced`.
pub async fn completing_a_call_twice_says_what_happened(h: impl Harness) {
    let inbox = h.inbox();
    let key = message_key("twice").unwrap();
    let idempotent::CallStart::Run(lease) = inbox
        .begin_call::<String>("orders", &key, "charge", Duration::from_secs(60))
        .await
        .unwrap()
    else {
        panic!("a new call was not ours to run");
    };
    inbox
        .complete_call(lease.clone(), &"ch_1".to_owned())
        .await
        .unwrap();
    inbox
        .complete_call(lease.clone(), &"ch_1".to_owned())
        .await
        .expect("completing again with the same result");
    let error = inbox
        .complete_call(lease.clone(), &"ch_2".to_owned())
        .await
        .unwrap_err();
    assert!(
        matches!(error, InboxError::CallCompleted { fence: 1 }),
        "{error:?}"
    );
    match inbox
        .begin_call::<String>("orders", &key, "charge", Duration::from_secs(60))
        .await
        .unwrap()
    {
        idempotent::CallStart::Completed(result) => assert_eq!(result, "ch_1"),
        idempotent::CallStart::Run(_) => panic!("a completed call ran again"),
    }
}
