//! Batches: one statement claims many keys, the body runs for the new ones, one commit.

use idempotent::{Error, Handled, InboxError};

use crate::support::{Behaviour, Consumer, Delivery, Harness, TestError};

fn outcomes(handled: &[Handled<()>]) -> Vec<&'static str> {
    handled
        .iter()
        .map(|h| {
            if h.is_processed() {
                "processed"
            } else {
                "duplicate"
            }
        })
        .collect()
}

pub async fn batch_runs_the_body_only_for_new_keys(h: impl Harness) {
    let single = Delivery::new("batch-a");
    let before = h
        .deliver_batch(std::slice::from_ref(&single))
        .await
        .unwrap();
    assert_eq!(outcomes(&before), ["processed"]);
    let batch = [
        Delivery::new("batch-a"),
        Delivery::new("batch-b"),
        Delivery::new("batch-c"),
        Delivery::new("batch-b"), // the same message twice in one batch
    ];
    let handled = h.deliver_batch(&batch).await.unwrap();
    assert_eq!(
        outcomes(&handled),
        ["duplicate", "processed", "processed", "duplicate"]
    );
    for label in ["batch-a", "batch-b", "batch-c"] {
        assert_eq!(h.effects(label).await, 1, "{label}");
    }
    assert_eq!(h.inbox_rows().await, 3);
    // A batch does not touch other consumers' records.
    assert!(
        h.deliver(Consumer::Orders, &Delivery::new("batch-a"))
            .await
            .unwrap()
            .is_processed()
    );
}

pub async fn failing_body_rolls_back_the_whole_batch(h: impl Harness) {
    let batch = [
        Delivery::new("batch-d"),
        Delivery::new("batch-e").behaving(Behaviour::Fail),
        Delivery::new("batch-f"),
    ];
    let error = h.deliver_batch(&batch).await.unwrap_err();
    assert!(
        matches!(error, Error::Handler(TestError::Failed)),
        "{error:?}"
    );
    assert_eq!(
        h.effects("batch-d").await,
        0,
        "the batch's first effect was committed"
    );
    assert_eq!(h.inbox_rows().await, 0, "the batch's claims were committed");

    let redelivered = [
        Delivery::new("batch-d"),
        Delivery::new("batch-e"),
        Delivery::new("batch-f"),
    ];
    let handled = h.deliver_batch(&redelivered).await.unwrap();
    assert_eq!(outcomes(&handled), ["processed", "processed", "processed"]);
}

/// Four batches of overlapping keys at once, in different orders: no deadlock, and each message
/// has its effect once, in whichever batch claimed it first.
pub async fn overlapping_concurrent_batches_have_one_effect_each(h: impl Harness) {
    let labels: Vec<String> = (0..40).map(|i| format!("overlap-{i:02}")).collect();
    let batches: Vec<Vec<Delivery>> = (0..4)
        .map(|b| {
            let mut batch: Vec<Delivery> = labels[b * 8..b * 8 + 16]
                .iter()
                .map(|label| Delivery::new(label))
                .collect();
            if b % 2 == 1 {
                batch.reverse();
            }
            batch
        })
        .collect();
    let results = futures::future::join_all(batches.iter().map(|b| h.deliver_batch(b))).await;
    let mut processed = 0;
    for result in results {
        let handled = result.expect("a batch failed");
        processed += handled.iter().filter(|h| h.is_processed()).count();
    }
    let distinct = 8 * 3 + 16;
    assert_eq!(processed, distinct);
    for label in &labels[..distinct] {
        assert_eq!(h.effects(label).await, 1, "{label}");
    }
}

/// A batch with an outcome per message: a failing message in the middle rolls back only its own
/// work and claim; the others commit once; duplicates (inside the batch and from before) and an
/// empty key get their own outcomes; the failed message's redelivery runs it once.
pub async fn failing_message_in_a_batch_fails_alone(h: impl Harness) {
    let before = Delivery::new("each-before");
    assert!(
        h.deliver_batch(std::slice::from_ref(&before))
            .await
            .unwrap()[0]
            .is_processed()
    );
    let msgs = [
        Delivery::new("each-1"),
        Delivery::new("each-2").behaving(Behaviour::Fail),
        Delivery::new("each-3"),
        Delivery::new("each-1"),
        Delivery::new("each-before"),
        Delivery::new("each-empty").with_id(""),
        Delivery::new("each-4"),
    ];
    let outcomes = h.deliver_batch_each(&msgs).await.unwrap();
    let kinds: Vec<&str> = outcomes
        .iter()
        .map(|outcome| match outcome {
            Ok(Handled::Processed(())) => "processed",
            Ok(Handled::Duplicate { .. }) => "duplicate",
            Err(Error::Handler(_)) => "failed",
            Err(Error::Inbox(InboxError::Key(_))) => "bad key",
            Err(other) => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "processed",
            "failed",
            "processed",
            "duplicate",
            "duplicate",
            "bad key",
            "processed"
        ]
    );
    for (label, effects) in [
        ("each-1", 1),
        ("each-2", 0),
        ("each-3", 1),
        ("each-4", 1),
        ("each-before", 1),
    ] {
        assert_eq!(h.effects_of("batch", label).await, effects, "{label}");
    }
    assert!(!h.inbox().is_processed("batch", "each-2").await.unwrap());
    let retry = h
        .deliver_batch_each(&[Delivery::new("each-2"), Delivery::new("each-3")])
        .await
        .unwrap();
    assert!(
        matches!(retry[0], Ok(Handled::Processed(()))),
        "{:?}",
        retry[0]
    );
    assert!(
        matches!(retry[1], Ok(Handled::Duplicate { .. })),
        "{:?}",
        retry[1]
    );
    assert_eq!(h.effects_of("batch", "each-2").await, 1);
}
