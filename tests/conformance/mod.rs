//! The behaviour every backend must show, as async functions that take a fresh [`Harness`]; each
//! backend's test file runs all of them (`conformance_tests!`).

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::FutureExt;
use idempotent::{Error, Handled, InboxError, KeyError, Stage, message_key};
use tokio::sync::Notify;

use crate::support::{Behaviour, Consumer, Delivery, Harness};

mod adversarial;
mod batch;
mod lifecycle;
mod operations;
mod outbox;
mod outbox_held_keys;
mod outbox_isolation;
mod outbox_keyed_runs;
pub use adversarial::*;
pub use batch::*;
pub use lifecycle::*;
pub use operations::*;
pub use outbox::*;
pub use outbox_held_keys::*;
pub use outbox_isolation::*;
pub use outbox_keyed_runs::*;

pub async fn duplicate_delivery_runs_the_body_once(h: impl Harness) {
    let msg = Delivery::new("paid-1");
    let first = h.deliver(Consumer::Orders, &msg).await.unwrap();
    assert_eq!(first, Handled::Processed(()));
    for _ in 0..3 {
        let again = h.deliver(Consumer::Orders, &msg).await.unwrap();
        match again {
            Handled::Duplicate {
                consumer,
                key,
                response,
            } => {
                assert_eq!(consumer, "orders");
                assert_eq!(
                    response, None,
                    "no response is stored without store_response"
                );
                assert_eq!(key, message_key("paid-1").unwrap());
            }
            other => panic!("expected a duplicate, got {other:?}"),
        }
    }
    assert_eq!(h.effects("paid-1").await, 1);
    assert_eq!(h.inbox_rows().await, 1);
    assert!(h.inbox().is_processed("orders", "paid-1").await.unwrap());
}

pub async fn handler_error_leaves_no_inbox_row_and_the_redelivery_runs(h: impl Harness) {
    let failing = Delivery::new("fails-once").behaving(Behaviour::Fail);
    let error = h.deliver(Consumer::Orders, &failing).await.unwrap_err();
    assert!(matches!(
        error,
        Error::Handler(crate::support::TestError::Failed)
    ));
    assert!(
        !error.is_retryable(),
        "the handler's own error is the handler's to classify"
    );
    assert_eq!(
        h.effects("fails-once").await,
        0,
        "the failed body's effect was committed"
    );
    assert_eq!(
        h.inbox_rows().await,
        0,
        "the failed body's key was committed"
    );

    let redelivery = Delivery::new("fails-once");
    assert!(
        h.deliver(Consumer::Orders, &redelivery)
            .await
            .unwrap()
            .is_processed()
    );
    assert_eq!(h.effects("fails-once").await, 1);
}

pub async fn handler_that_always_fails_is_never_marked_done(h: impl Harness) {
    let failing = Delivery::new("poison").behaving(Behaviour::Fail);
    for _ in 0..5 {
        let error = h.deliver(Consumer::Orders, &failing).await.unwrap_err();
        assert!(error.handler_error().is_some());
    }
    assert_eq!(h.effects("poison").await, 0);
    assert!(!h.inbox().is_processed("orders", "poison").await.unwrap());
}

pub async fn panicking_body_commits_nothing(h: impl Harness) {
    let panicking = Delivery::new("panics").behaving(Behaviour::Panic);
    let caught = AssertUnwindSafe(h.deliver(Consumer::Orders, &panicking))
        .catch_unwind()
        .await;
    assert!(caught.is_err(), "the panic did not reach the caller");
    assert_eq!(h.effects("panics").await, 0);
    assert_eq!(h.inbox_rows().await, 0);

    let redelivery = Delivery::new("panics");
    assert!(
        h.deliver(Consumer::Orders, &redelivery)
            .await
            .unwrap()
            .is_processed()
    );
    assert_eq!(h.effects("panics").await, 1);
}

pub async fn cancelled_call_commits_nothing(h: impl Harness) {
    let started = Arc::new(Notify::new());
    let hanging = Delivery::new("cancelled").behaving(Behaviour::Hang(started.clone()));
    tokio::select! {
        outcome = h.deliver(Consumer::Orders, &hanging) => panic!("a hanging body returned {outcome:?}"),
        () = started.notified() => {} // the body has written its effect; drop the call here
    }
    assert_eq!(h.effects("cancelled").await, 0);
    assert!(!h.inbox().is_processed("orders", "cancelled").await.unwrap());

    let redelivery = Delivery::new("cancelled");
    assert!(
        h.deliver(Consumer::Orders, &redelivery)
            .await
            .unwrap()
            .is_processed()
    );
    assert_eq!(h.effects("cancelled").await, 1);
}

/// A body may nest transactions on its connection: they are savepoints inside the handler's
/// transaction, so a nested commit commits nothing yet and the body's error still undoes it all.
pub async fn nested_transactions_in_the_body_are_savepoints(h: impl Harness) {
    let counts = async |label: &str| {
        let mut counts = Vec::new();
        for consumer in ["savepoint-undone", "savepoint-kept", "savepoints"] {
            counts.push(h.effects_of(consumer, label).await);
        }
        counts
    };
    let failing = Delivery::new("nested").behaving(Behaviour::Fail);
    let error = h.deliver_savepoints(&failing).await.unwrap_err();
    assert!(matches!(error, Error::Handler(_)), "{error:?}");
    assert_eq!(counts("nested").await, [0, 0, 0], "a failed body committed");
    assert!(
        !h.inbox()
            .is_processed("savepoints", "nested")
            .await
            .unwrap()
    );

    let outcome = h.deliver_savepoints(&Delivery::new("nested")).await;
    assert!(matches!(outcome, Ok(Handled::Processed(()))), "{outcome:?}");
    assert_eq!(counts("nested").await, [0, 1, 1]);
    let again = h.deliver_savepoints(&Delivery::new("nested")).await;
    assert!(matches!(again, Ok(Handled::Duplicate { .. })), "{again:?}");
    assert_eq!(counts("nested").await, [0, 1, 1]);
}

/// A worker's inbox begins each transaction on the connection its last one ended cleanly on
/// (a temporary table, which only its session sees, shows it), and handles every outcome as the
/// shared inbox does.
pub async fn worker_inbox_keeps_its_connection_between_messages(h: impl Harness) {
    let worker = h.inbox().for_worker();
    let mut first = worker
        .claim("orders", &message_key("kept-1").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert!(
        h.run_in(&mut first, "CREATE TEMPORARY TABLE kept_marker (x INTEGER)")
            .await
    );
    first.commit().await.unwrap();

    let paid = Delivery::new("kept-paid");
    let failing = Delivery::new("kept-failing").behaving(Behaviour::Fail);
    let deliver = async |msg: &Delivery| h.deliver_on(&worker, Consumer::Orders, msg).await;
    assert!(deliver(&paid).await.unwrap().is_processed());
    assert!(deliver(&paid).await.unwrap().is_duplicate());
    assert!(matches!(deliver(&failing).await, Err(Error::Handler(_))));

    // Take every idle connection from the pool (once those handed back have arrived there), so
    // that the next claim cannot be given the first one's connection back by the pool.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let idle: Vec<_> = std::iter::from_fn(|| h.inbox().pool().try_acquire()).collect();
    let mut last = worker
        .claim("orders", &message_key("kept-2").unwrap())
        .await
        .unwrap()
        .unwrap();
    let same_session = h
        .run_in(&mut last, "SELECT COUNT(*) FROM kept_marker")
        .await;
    assert!(
        same_session,
        "the worker's inbox did not keep its connection"
    );
    last.commit().await.unwrap();
    drop(idle);

    let panicking = Delivery::new("kept-panicking").behaving(Behaviour::Panic);
    let panicked = AssertUnwindSafe(deliver(&panicking)).catch_unwind().await;
    assert!(panicked.is_err());
    for label in ["kept-panicking", "kept-failing"] {
        let redelivery = Delivery::new(label);
        assert!(deliver(&redelivery).await.unwrap().is_processed());
    }
    drop(worker); // gives its connection back (the in-memory database has only one)
    for label in ["kept-paid", "kept-failing", "kept-panicking"] {
        assert_eq!(h.effects(label).await, 1, "{label}");
    }
    assert_eq!(h.inbox_rows().await, 5);
}

pub async fn concurrent_deliveries_have_one_effect(h: impl Harness) {
    let msg = Delivery::new("stampede");
    let outcomes =
        futures::future::join_all((0..32).map(|_| h.deliver(Consumer::Orders, &msg))).await;
    let processed = outcomes
        .iter()
        .filter(|o| matches!(o, Ok(Handled::Processed(()))))
        .count();
    let duplicates = outcomes
        .iter()
        .filter(|o| matches!(o, Ok(Handled::Duplicate { .. })))
        .count();
    let errors: Vec<_> = outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
    assert!(errors.is_empty(), "deliveries failed: {errors:?}");
    assert_eq!((processed, duplicates), (1, 31));
    assert_eq!(h.effects("stampede").await, 1);
    assert_eq!(h.inbox_rows().await, 1);
}

/// Holds an uncommitted claim on the message's key, delivers the message meanwhile, checks that the
/// delivery waits, then commits or rolls back the held claim and returns the delivery's outcome.
async fn deliver_while_a_claim_is_held<H: Harness>(
    h: &H,
    msg: &Delivery,
    commit_the_held_claim: bool,
) -> Handled<()> {
    let key = message_key(&msg.message_id).unwrap();
    let held = h
        .inbox()
        .claim("orders", &key)
        .await
        .unwrap()
        .expect("a fresh key is claimed");
    let finished = AtomicBool::new(false);
    let (outcome, ()) = tokio::join!(
        async {
            let outcome = h.deliver(Consumer::Orders, msg).await;
            finished.store(true, Ordering::SeqCst);
            outcome
        },
        async {
            h.wait_until_a_claim_blocks().await;
            assert!(
                !finished.load(Ordering::SeqCst),
                "the delivery did not wait for the uncommitted claim"
            );
            if commit_the_held_claim {
                held.commit().await.unwrap();
            } else {
                held.rollback().await;
            }
        }
    );
    outcome.unwrap()
}

pub async fn claim_waits_for_an_uncommitted_claim_then_sees_its_commit(h: impl Harness) {
    let msg = Delivery::new("held-then-committed");
    let outcome = deliver_while_a_claim_is_held(&h, &msg, true).await;
    assert!(outcome.is_duplicate(), "got {outcome:?}");
    assert_eq!(h.effects("held-then-committed").await, 0);
    assert_eq!(h.inbox_rows().await, 1);
}

pub async fn claim_waits_for_an_uncommitted_claim_then_runs_after_its_rollback(h: impl Harness) {
    let msg = Delivery::new("held-then-rolled-back");
    let outcome = deliver_while_a_claim_is_held(&h, &msg, false).await;
    assert!(outcome.is_processed(), "got {outcome:?}");
    assert_eq!(h.effects("held-then-rolled-back").await, 1);
    assert_eq!(h.inbox_rows().await, 1);
}

/// A delivery dropped while its claim waits (a timeout around the handler, say) leaves nothing
/// open on the server: once the held claim rolls back, the next deliveries neither wait for a
/// leftover claim nor find one, and the message is processed once.
pub async fn claim_dropped_while_it_waits_leaves_nothing_open(h: impl Harness) {
    let msg = Delivery::new("dropped-while-waiting");
    let key = message_key(&msg.message_id).unwrap();
    let held = h.inbox().claim("orders", &key).await.unwrap().unwrap();
    tokio::select! {
        outcome = h.deliver(Consumer::Orders, &msg) => {
            panic!("a delivery returned while the claim it waits for was held: {outcome:?}")
        }
        () = h.wait_until_a_claim_blocks() => {} // drop the waiting delivery here
    }
    held.rollback().await;
    // A leftover claim would make the redelivery wait for ever, or report the message a duplicate.
    let outcome = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        h.deliver(Consumer::Orders, &msg),
    )
    .await
    .expect("the redelivery waited on a claim nobody holds");
    assert!(matches!(outcome, Ok(Handled::Processed(()))), "{outcome:?}");
    assert_eq!(h.effects("dropped-while-waiting").await, 1);
}

pub async fn claim_that_waits_too_long_fails_retryably_and_commits_nothing(h: impl Harness) {
    let msg = Delivery::new("lock-timeout");
    let key = message_key(&msg.message_id).unwrap();
    let held = h.inbox().claim("orders", &key).await.unwrap().unwrap();
    let error = h.deliver_impatiently(&msg).await.unwrap_err();
    match &error {
        Error::Inbox(InboxError::Database { stage, .. }) => {
            assert!(matches!(stage, Stage::Begin | Stage::Claim), "{stage:?}")
        }
        other => panic!("expected a database error, got {other:?}"),
    }
    assert!(
        error.is_retryable(),
        "a lock timeout must be retryable: {error:?}"
    );
    held.commit().await.unwrap();
    assert!(
        h.deliver(Consumer::Orders, &msg)
            .await
            .unwrap()
            .is_duplicate()
    );
    assert_eq!(h.effects("lock-timeout").await, 0);
}

/// One rollback releases several waiting claims at once. Exactly one of them runs the body; the
/// others report a duplicate, or (InnoDB, when it picks a deadlock victim among the waiters) a
/// retryable error whose retry reports a duplicate.
pub async fn several_waiters_released_by_a_rollback_have_one_effect(h: impl Harness) {
    let msg = Delivery::new("rollback-stampede");
    let key = message_key(&msg.message_id).unwrap();
    let held = h.inbox().claim("orders", &key).await.unwrap().unwrap();
    let (outcomes, ()) = tokio::join!(
        futures::future::join_all((0..3).map(|_| h.deliver(Consumer::Orders, &msg))),
        async {
            h.wait_until_a_claim_blocks().await;
            held.rollback().await;
        }
    );
    let mut processed = 0;
    for outcome in outcomes {
        match outcome {
            Ok(Handled::Processed(())) => processed += 1,
            Ok(Handled::Duplicate { .. }) => {}
            Err(error) => {
                assert!(error.is_retryable(), "{error:?}");
                let retry = h.deliver(Consumer::Orders, &msg).await.unwrap();
                assert!(retry.is_duplicate(), "{retry:?}");
            }
        }
    }
    assert_eq!(processed, 1);
    assert_eq!(h.effects("rollback-stampede").await, 1);
}

pub async fn two_consumers_each_process_the_message_once(h: impl Harness) {
    let msg = Delivery::new("shared-event");
    for attempt in 0..2 {
        let orders = h.deliver(Consumer::Orders, &msg).await.unwrap();
        let billing = h.deliver(Consumer::Billing, &msg).await.unwrap();
        assert_eq!(orders.is_processed(), attempt == 0);
        assert_eq!(billing.is_processed(), attempt == 0);
    }
    assert_eq!(h.effects_of("orders", "shared-event").await, 1);
    assert_eq!(h.effects_of("billing", "shared-event").await, 1);
    assert_eq!(h.inbox_rows().await, 2);
}

pub async fn empty_key_is_refused_before_any_effect(h: impl Harness) {
    let empty = Delivery::new("empty-key").with_id("");
    let error = h.deliver(Consumer::Orders, &empty).await.unwrap_err();
    assert!(
        matches!(
            error,
            Error::Inbox(InboxError::Key(KeyError::Empty { component: 0 }))
        ),
        "got {error:?}"
    );
    assert!(!error.is_retryable());
    let empty_bytes = Delivery::new("empty-raw-key").with_raw_id(Vec::new());
    assert!(matches!(
        h.deliver(Consumer::OrdersByRawId, &empty_bytes).await,
        Err(Error::Inbox(InboxError::Key(_)))
    ));
    assert_eq!(
        h.effects("empty-key").await + h.effects("empty-raw-key").await,
        0
    );
    assert_eq!(h.inbox_rows().await, 0);
}

pub async fn odd_keys_are_handled_once_each(h: impl Harness) {
    let huge = "k".repeat(1 << 20);
    let cases = [
        Delivery::new("huge-key").with_id(huge.clone()),
        Delivery::new("huge-key-plus-one").with_id(huge + "k"),
        Delivery::new("nul-a").with_id("a\0b"),
        Delivery::new("nul-b").with_id("a\0c"),
        Delivery::new("nul-only").with_id("\0"),
        Delivery::new("non-utf8").with_raw_id(vec![0xff, 0xfe, 0x00, 0xc3]),
        Delivery::new("non-utf8-other").with_raw_id(vec![0xff, 0xfe, 0x00, 0xc4]),
    ];
    for msg in &cases {
        let consumer = if msg.label.starts_with("non-utf8") {
            Consumer::OrdersByRawId
        } else {
            Consumer::Orders
        };
        for attempt in 0..2 {
            let outcome = h.deliver(consumer, msg).await.unwrap();
            assert_eq!(
                outcome.is_processed(),
                attempt == 0,
                "{}: {outcome:?}",
                msg.label
            );
        }
        assert_eq!(h.effects(&msg.label).await, 1, "{}", msg.label);
    }
    assert_eq!(h.inbox_rows().await, cases.len() as i64);
}

pub async fn migrate_is_idempotent_and_concurrent_safe(h: impl Harness) {
    let inbox = h.inbox().clone();
    let results = futures::future::join_all((0..4).map(|_| inbox.migrate())).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let outcome = h
        .deliver(Consumer::Orders, &Delivery::new("after-migrate"))
        .await
        .unwrap();
    assert!(outcome.is_processed());
    assert_eq!(h.inbox_rows().await, 1);
}

/// Declares one `#[tokio::test]` per conformance case, each with a fresh harness from `$new`.
/// `@pooled`: every case but the one a pooler in transaction mode cannot keep (a worker's server
/// session), for a harness behind PgBouncer.
macro_rules! conformance_tests {
    ($new:expr) => {
        conformance_tests!(@pooled $new);
        conformance_tests!(@cases $new; worker_inbox_keeps_its_connection_between_messages);
    };
    // Galera: the outbox's row locks are one node's, so the cases that need two inboxes to meet in
    // a lock run with both on one node (`@shared_locks`), and tests/mysql/galera.rs says what happens
    // across nodes.
    (@galera $new:expr) => {
        conformance_tests!(@unshared_locks $new);
        conformance_tests!(@cases $new; worker_inbox_keeps_its_connection_between_messages);
    };
    (@pooled $new:expr) => {
        conformance_tests!(@unshared_locks $new);
        conformance_tests!(@shared_locks $new);
    };
    (@shared_locks $new:expr) => {
        conformance_tests!(@cases $new;
            two_relays_never_publish_one_row_at_once
            ordering_per_key_holds_under_concurrent_producers
            keyed_writers_racing_relays_never_deadlock
            a_second_writer_of_an_ordering_key_waits_for_the_first_commit
            two_relays_never_let_a_held_keys_later_message_out
            relays_racing_over_many_keys_keep_each_keys_order_and_publish_once
        );
    };
    (@unshared_locks $new:expr) => {
        conformance_tests!(@cases $new;
            duplicate_delivery_runs_the_body_once
            handler_error_leaves_no_inbox_row_and_the_redelivery_runs
            handler_that_always_fails_is_never_marked_done
            panicking_body_commits_nothing
            cancelled_call_commits_nothing
            nested_transactions_in_the_body_are_savepoints
            concurrent_deliveries_have_one_effect
            claim_waits_for_an_uncommitted_claim_then_sees_its_commit
            claim_waits_for_an_uncommitted_claim_then_runs_after_its_rollback
            claim_dropped_while_it_waits_leaves_nothing_open
            claim_that_waits_too_long_fails_retryably_and_commits_nothing
            several_waiters_released_by_a_rollback_have_one_effect
            two_consumers_each_process_the_message_once
            empty_key_is_refused_before_any_effect
            odd_keys_are_handled_once_each
            migrate_is_idempotent_and_concurrent_safe
            purge_deletes_expired_rows_in_batches_while_claims_continue
            retention_is_per_consumer
            message_redelivered_after_its_row_was_purged_is_processed_again
            background_purger_deletes_expired_rows
            duplicate_returns_the_stored_response
            same_key_with_a_different_payload_is_an_error
            body_is_handed_a_stable_idempotency_key
            metrics_count_what_happened
            call_once_calls_once_and_returns_the_stored_result
            dropped_call_is_in_progress_until_its_lease_expires_then_taken_over
            late_writer_is_fenced_off
            a_released_call_runs_again_at_once_and_only_its_holder_releases_it
            concurrent_call_attempts_make_one_call
            batch_runs_the_body_only_for_new_keys
            failing_body_rolls_back_the_whole_batch
            overlapping_concurrent_batches_have_one_effect_each
            failing_message_in_a_batch_fails_alone
            body_that_swallows_a_failed_statement_is_never_processed_without_its_commit
            body_that_ends_the_transaction_is_never_reported_processed
            body_that_ends_the_transaction_is_reported_truthfully_on_every_path
            body_that_ends_the_transaction_and_panics_leaves_a_pool_of_one_working
            handler_dropped_at_every_await_point_leaves_a_pool_of_one_working
            worker_inbox_on_a_pool_of_one_reads_on_its_own_connection
            bad_names_and_leases_are_refused_before_any_database_work
            completing_a_call_twice_says_what_happened
            purged_message_with_a_uuid_v7_key_is_refused_not_run_again
            purged_message_with_a_send_time_field_is_refused_and_one_without_is_run_again
            call_records_are_purged_with_the_retention
            inspect_and_list_show_what_the_inbox_holds
            stuck_calls_and_stats_show_what_needs_a_look
            forget_runs_a_message_again_and_leaves_an_audit_row
            migrate_upgrades_the_first_release_tables_without_losing_rows
            migrate_refuses_a_schema_newer_than_the_library
            rolled_back_body_leaves_no_outgoing_row
            committed_body_leaves_exactly_its_rows
            body_with_outgoing_messages_that_ends_its_transaction_is_never_processed
            rerun_after_rollback_yields_the_same_ids
            outgoing_rows_commit_with_the_callers_own_transaction
            unusable_outgoing_message_fails_the_handler_and_commits_nothing
            handler_with_an_outbox_dropped_at_every_await_point_writes_its_rows_once
            relay_batch_dropped_at_every_await_point_loses_no_row
            poison_is_parked_never_blocks_the_rest_and_is_retryable_by_hand
            a_parked_message_holds_its_key_and_goes_out_first_once_retried
            a_skipped_message_lets_its_key_go_on_and_is_purged_as_sent
            unconfirmed_messages_stay_pending_without_counting_an_attempt
            keys_in_back_off_take_no_slots_from_ready_keys
            a_refused_message_holds_back_the_rest_of_its_keys_batch
            sent_outgoing_rows_are_purged_after_the_outbox_retention
            migrate_upgrades_version_2_tables_to_the_outbox
        );
    };
    (@cases $new:expr; $($case:ident)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $case() {
            crate::conformance::$case($new).await;
        }
    )*};
}
pub(crate) use conformance_tests;
