//! The inbox's lifecycle on every backend: retention and purge, calls to outside services, stored
//! responses, payload fingerprints, the idempotency key handed to the body, and the counters.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idempotent::{
    CallStart, Error, Handled, IdempotencyKey, InboxError, PurgerOptions, message_key,
};
use tokio::sync::Notify;

use crate::support::{Consumer, Delivery, Harness};

const DAY: Duration = Duration::from_secs(24 * 60 * 60);

pub async fn purge_deletes_expired_rows_in_batches_while_claims_continue(h: impl Harness) {
    h.bulk_rows("old", 3000).await;
    h.backdate("old", 30 * DAY).await;
    for i in 0..20 {
        let msg = Delivery::new(&format!("recent-{i}"));
        assert!(
            h.deliver(Consumer::Orders, &msg)
                .await
                .unwrap()
                .is_processed()
        );
    }
    let h = &h;
    let (report, outcomes) = tokio::join!(
        h.inbox().purge_expired(250),
        futures::future::join_all((0..100).map(|i| async move {
            h.deliver(Consumer::Billing, &Delivery::new(&format!("during-{i}")))
                .await
        }))
    );
    let report = report.unwrap();
    assert_eq!(report.deleted, 3000);
    assert!(report.batches >= 12, "{report:?}");
    assert!(!report.locked_elsewhere);
    for outcome in outcomes {
        assert!(
            outcome.unwrap().is_processed(),
            "a claim failed during the purge"
        );
    }
    assert_eq!(
        h.inbox_rows().await,
        120,
        "rows younger than the retention must survive"
    );
    assert_eq!(h.inbox().metrics().rows_purged, 3000);

    // Nothing left to purge: a second purge deletes nothing.
    assert_eq!(h.inbox().purge_expired(250).await.unwrap().deleted, 0);
}

pub async fn retention_is_per_consumer(h: impl Harness) {
    let msg = Delivery::new("kept-longer");
    assert!(
        h.deliver(Consumer::Orders, &msg)
            .await
            .unwrap()
            .is_processed()
    );
    assert!(
        h.deliver(Consumer::Billing, &msg)
            .await
            .unwrap()
            .is_processed()
    );
    h.backdate("orders", 20 * DAY).await;
    h.backdate("billing", 20 * DAY).await;
    let inbox = h
        .inbox()
        .clone()
        .with_retention(10 * DAY)
        .with_consumer_retention("billing", 30 * DAY);
    assert_eq!(inbox.retention().of("orders"), 10 * DAY);
    assert_eq!(inbox.retention().of("billing"), 30 * DAY);
    let report = inbox.purge_expired(100).await.unwrap();
    assert_eq!(report.deleted, 1);
    assert!(
        !h.inbox()
            .is_processed("orders", "kept-longer")
            .await
            .unwrap()
    );
    assert!(
        h.inbox()
            .is_processed("billing", "kept-longer")
            .await
            .unwrap()
    );
}

/// The documented limit: a message redelivered after its row was purged is processed again.
pub async fn message_redelivered_after_its_row_was_purged_is_processed_again(h: impl Harness) {
    let msg = Delivery::new("too-late");
    assert!(
        h.deliver(Consumer::Orders, &msg)
            .await
            .unwrap()
            .is_processed()
    );
    h.backdate("orders", 15 * DAY).await;
    assert_eq!(h.inbox().purge_expired(100).await.unwrap().deleted, 1);
    assert!(
        h.deliver(Consumer::Orders, &msg)
            .await
            .unwrap()
            .is_processed()
    );
    assert_eq!(h.effects("too-late").await, 2);
}

pub async fn background_purger_deletes_expired_rows(h: impl Harness) {
    h.bulk_rows("old", 500).await;
    h.backdate("old", 30 * DAY).await;
    let purger = h
        .inbox()
        .spawn_purger(PurgerOptions::every(Duration::from_millis(50)).batch_size(100));
    // The purger counts a batch once the database answered, after the rows are gone.
    for _ in 0..200 {
        if h.inbox_rows().await == 0 && h.inbox().metrics().rows_purged == 500 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    purger.stop();
    assert_eq!(h.inbox_rows().await, 0);
    assert_eq!(h.inbox().metrics().rows_purged, 500);
}

pub async fn duplicate_returns_the_stored_response(h: impl Harness) {
    let msg = Delivery::new("quote-1");
    let first = h.deliver_quote(&msg).await.unwrap();
    assert_eq!(first, Handled::Processed("quote for quote-1".to_owned()));
    let again = h.deliver_quote(&msg).await.unwrap();
    match again {
        Handled::Duplicate { response, .. } => {
            assert_eq!(response.as_deref(), Some("quote for quote-1"))
        }
        other => panic!("expected a duplicate, got {other:?}"),
    }
    assert_eq!(h.effects("quote-1").await, 1);
}

pub async fn same_key_with_a_different_payload_is_an_error(h: impl Harness) {
    let original = Delivery::new("pay-1").with_id("payment-message-1");
    assert!(h.deliver_payment(&original).await.unwrap().is_processed());
    assert!(h.deliver_payment(&original).await.unwrap().is_duplicate());
    let reused = Delivery::new("pay-2").with_id("payment-message-1");
    let error = h.deliver_payment(&reused).await.unwrap_err();
    assert!(
        matches!(
            &error,
            Error::Inbox(InboxError::FingerprintMismatch { consumer, .. }) if consumer == "payments"
        ),
        "{error:?}"
    );
    assert!(!error.is_retryable());
    assert_eq!(h.effects("pay-1").await + h.effects("pay-2").await, 1);
    assert_eq!(h.inbox().metrics().fingerprint_mismatches, 1);
}

pub async fn body_is_handed_a_stable_idempotency_key(h: impl Harness) {
    let msg = Delivery::new("keyed-1");
    assert!(h.deliver_keyed(&msg).await.unwrap().is_processed());
    let expected = IdempotencyKey::new("keyed", &message_key("keyed-1").unwrap());
    assert_eq!(h.effects_of("keyed", expected.as_str()).await, 1);
    assert_ne!(
        expected,
        IdempotencyKey::new("orders", &message_key("keyed-1").unwrap()),
        "consumers must not share idempotency keys"
    );
    assert_eq!(expected.as_str().len(), 64);
}

pub async fn metrics_count_what_happened(h: impl Harness) {
    let msg = Delivery::new("counted");
    assert!(
        h.deliver(Consumer::Orders, &msg)
            .await
            .unwrap()
            .is_processed()
    );
    assert!(
        h.deliver(Consumer::Orders, &msg)
            .await
            .unwrap()
            .is_duplicate()
    );
    let failing = Delivery::new("counted-failure").behaving(crate::support::Behaviour::Fail);
    h.deliver(Consumer::Orders, &failing).await.unwrap_err();
    let metrics = h.inbox().metrics();
    assert_eq!(
        (metrics.processed, metrics.duplicates, metrics.rolled_back),
        (1, 1, 1)
    );
}

pub async fn call_once_calls_once_and_returns_the_stored_result(h: impl Harness) {
    let key = message_key("charge-1").unwrap();
    let calls = AtomicUsize::new(0);
    let charge = || async {
        calls.fetch_add(1, Ordering::SeqCst);
        Ok::<_, std::io::Error>("charge-id-7".to_owned())
    };
    let lease = Duration::from_secs(30);
    let first: String = h
        .inbox()
        .call_once("orders", &key, "charge", lease, |_| charge())
        .await
        .unwrap();
    let second: String = h
        .inbox()
        .call_once("orders", &key, "charge", lease, |_| charge())
        .await
        .unwrap();
    assert_eq!(
        (first.as_str(), second.as_str()),
        ("charge-id-7", "charge-id-7")
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// The first attempt records the call as pending, starts it, and is dropped (its process died).
pub async fn dropped_call_is_in_progress_until_its_lease_expires_then_taken_over(h: impl Harness) {
    let key = message_key("charge-2").unwrap();
    let lease = Duration::from_millis(400);
    let started = Arc::new(Notify::new());
    let hanging = h.inbox().call_once("orders", &key, "charge", lease, |_| {
        let started = started.clone();
        async move {
            started.notify_one();
            std::future::pending::<Result<String, std::io::Error>>().await
        }
    });
    tokio::select! {
        _ = hanging => panic!("a hanging call returned"),
        () = started.notified() => {}
    }

    // While its lease lives, another attempt is told to retry later.
    let error = h
        .inbox()
        .begin_call::<String>("orders", &key, "charge", lease)
        .await
        .unwrap_err();
    let InboxError::CallInProgress { retry_after } = error else {
        panic!("expected in progress, got {error:?}");
    };
    assert!(retry_after <= lease);
    assert!(error.is_retryable());
    assert_eq!(h.inbox().metrics().calls_in_progress, 1);

    // After the lease, a new attempt takes over with a higher fence and completes the call.
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let result: String = h
        .inbox()
        .call_once("orders", &key, "charge", lease, |lease| async move {
            assert_eq!(lease.fence(), 2);
            Ok::<_, std::io::Error>("charged once more".to_owned())
        })
        .await
        .unwrap();
    assert_eq!(result, "charged once more");
}

/// The first attempt is slow, not dead: its lease runs out, a second attempt takes over, and the
/// first one's late result must not overwrite the second's.
pub async fn late_writer_is_fenced_off(h: impl Harness) {
    let key = message_key("charge-3").unwrap();
    let lease = Duration::from_millis(300);
    let CallStart::Run(first) = h
        .inbox()
        .begin_call::<String>("orders", &key, "charge", lease)
        .await
        .unwrap()
    else {
        panic!("a new call was not started");
    };
    assert_eq!(first.fence(), 1);
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let CallStart::Run(second) = h
        .inbox()
        .begin_call::<String>("orders", &key, "charge", lease)
        .await
        .unwrap()
    else {
        panic!("the expired call was not taken over");
    };
    assert_eq!(second.fence(), 2);
    assert_eq!(first.idempotency_key(), second.idempotency_key());

    let late = h.inbox().complete_call(first, &"late".to_owned()).await;
    assert!(
        matches!(late, Err(InboxError::Fenced { fence: 1 })),
        "{late:?}"
    );
    h.inbox()
        .complete_call(second, &"winner".to_owned())
        .await
        .unwrap();
    match h
        .inbox()
        .begin_call::<String>("orders", &key, "charge", lease)
        .await
        .unwrap()
    {
        CallStart::Completed(result) => assert_eq!(result, "winner"),
        CallStart::Run(_) => panic!("a completed call ran again"),
    }
    assert_eq!(h.inbox().metrics().calls_fenced, 1);
}

/// A released call is gone: the next attempt runs at once instead of waiting for the lease. An
/// attempt whose lease was taken over releases nothing: the call stays with the later attempt, and
/// a completed call cannot be released.
pub async fn a_released_call_runs_again_at_once_and_only_its_holder_releases_it(h: impl Harness) {
    let inbox = h.inbox();
    let run = |start: CallStart<String>| match start {
        CallStart::Run(lease) => lease,
        CallStart::Completed(result) => panic!("not run: completed with {result}"),
    };
    let key = message_key("released").unwrap();
    let long = Duration::from_secs(60);
    let first = run(inbox
        .begin_call("orders", &key, "charge", long)
        .await
        .unwrap());
    let busy = inbox
        .begin_call::<String>("orders", &key, "charge", long)
        .await;
    assert!(
        matches!(busy, Err(InboxError::CallInProgress { .. })),
        "{busy:?}"
    );
    assert!(inbox.release_call(first).await.unwrap());
    let second = run(inbox
        .begin_call("orders", &key, "charge", long)
        .await
        .unwrap());
    inbox
        .complete_call(second.clone(), &"done".to_owned())
        .await
        .unwrap();
    assert!(
        !inbox.release_call(second).await.unwrap(),
        "a completed call stays"
    );

    let key = message_key("taken-over").unwrap();
    let short = Duration::from_millis(200);
    let stale = run(inbox
        .begin_call("orders", &key, "charge", short)
        .await
        .unwrap());
    tokio::time::sleep(short + Duration::from_millis(100)).await;
    let current = run(inbox
        .begin_call("orders", &key, "charge", long)
        .await
        .unwrap());
    assert_eq!((stale.fence(), current.fence()), (1, 2));
    assert!(!inbox.release_call(stale).await.unwrap());
    let busy = inbox
        .begin_call::<String>("orders", &key, "charge", long)
        .await;
    assert!(
        matches!(busy, Err(InboxError::CallInProgress { .. })),
        "{busy:?}"
    );
    assert!(inbox.release_call(current).await.unwrap());
}

pub async fn concurrent_call_attempts_make_one_call(h: impl Harness) {
    let key = message_key("charge-4").unwrap();
    let calls = AtomicUsize::new(0);
    let attempts = (0..8).map(|_| {
        h.inbox().call_once(
            "orders",
            &key,
            "charge",
            Duration::from_secs(30),
            |_| async {
                calls.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
                Ok::<_, std::io::Error>(42u32)
            },
        )
    });
    let results = futures::future::join_all(attempts).await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the call was made more than once"
    );
    let mut completed = 0;
    for result in results {
        match result {
            Ok(value) => {
                assert_eq!(value, 42);
                completed += 1;
            }
            Err(Error::Inbox(e @ InboxError::CallInProgress { .. })) => assert!(e.is_retryable()),
            Err(other) => panic!("{other:?}"),
        }
    }
    assert!(completed >= 1);
    let stored: u32 = h
        .inbox()
        .call_once(
            "orders",
            &key,
            "charge",
            Duration::from_secs(30),
            |_| async { Err::<u32, _>(std::io::Error::other("must not be called")) },
        )
        .await
        .unwrap();
    assert_eq!(stored, 42);
}
