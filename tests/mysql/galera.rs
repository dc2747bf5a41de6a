//! The inbox on a three-node MariaDB Galera cluster (`IDEMPOTENT_GALERA_URLS`, which
//! `scripts/galera start` sets): the conformance suite with its connections on different nodes,
//! and what is different across nodes.
//!
//! On one node, a claim waits for another transaction's uncommitted claim of the same key, as on
//! InnoDB. Across nodes nothing waits: both inserts succeed, each on its own node, and the first
//! transaction to commit wins. The other is rolled back by the cluster: its commit fails
//! certification, or the winner's write-set, applied on its node, aborts it first (a "brute-force
//! abort"); either way its client gets error 1213, which is retryable, with nothing of it
//! committed, and the retry finds the key: a duplicate.
#![cfg(feature = "mysql")]

#[path = "../conformance/mod.rs"]
mod conformance;
#[path = "../support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use idempotent::{Error, Handled, Inbox, InboxError, Stage, message_key};
use support::mysql::{MySqlHarness, causal};
use support::{Consumer, Delivery, Harness, Outcome};

use conformance::conformance_tests;
use conformance::{drained_payloads, keyed, two_relays_drain_forty_messages};

conformance_tests!(@galera MySqlHarness::on_galera().await);

/// The outbox's cases where two inboxes must meet in a row lock, with both on one node: relays
/// and the writers of an ordering key on one node (as the README's "Running at scale" says to run
/// them), the producers on any.
mod locks_on_one_node {
    use super::*;
    conformance_tests!(@shared_locks MySqlHarness::on_galera().await.others_on_node(0));
}

/// Relays on two nodes (a row lock is one node's):
/// both may take and publish a row, and the second to commit its batch is refused by the cluster.
/// Every row is still published and ends marked sent, under its stable id, so the downstream inbox
/// drops the copy. (Relays that share their locks publish a row once:
/// `two_relays_never_publish_one_row_at_once`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_on_two_nodes_publish_every_row_at_least_once() {
    let h = MySqlHarness::on_galera().await;
    let (recorder, _, _) = two_relays_drain_forty_messages(&h, false).await;
    let counts = recorder.counts();
    let rows = h.outbox_rows().await;
    assert_eq!(rows.len(), 40);
    for row in &rows {
        assert!(
            counts.get(&row.0).is_some_and(|n| *n >= 1),
            "{} was lost",
            row.0
        );
    }
    assert_eq!(counts.len(), 40, "a message no row holds was published");
    assert!(
        rows.iter().all(|row| row.4 == 1),
        "a row is not marked sent"
    );
    let copies: usize = counts.values().map(|n| n - 1).sum();
    println!("40 rows, {copies} published twice");
}

/// Writers of one ordering key on two nodes: the second does not
/// wait for the first; the first to commit wins, the other's commit is refused (retryably: a
/// handler's is retried by the broker), and the relay publishes the key in the order the two
/// finally committed. (Writers that share their locks wait:
/// `a_second_writer_of_an_ordering_key_waits_for_the_first_commit`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_of_a_key_on_two_nodes_commit_one_at_a_time() {
    let h = MySqlHarness::on_galera().await;
    let mut first = h.inbox().pool().begin().await.unwrap();
    h.inbox().enqueue(&mut first, keyed("first")).await.unwrap();
    let other = h.inbox_with_pool(2);
    let mut second = other.pool().begin().await.unwrap();
    tokio::time::timeout(
        Duration::from_secs(5),
        other.enqueue(&mut second, keyed("second")),
    )
    .await
    .expect("the second writer waited for the first")
    .unwrap();
    second.commit().await.unwrap();
    let refused = first
        .commit()
        .await
        .expect_err("both writers of the key committed the same number");
    let code = refused.as_database_error().and_then(|e| e.code());
    assert_eq!(code.as_deref(), Some("40001"), "{refused:?}");
    // Written again, as a redelivery would: retried while the cluster refuses it as it refused the
    // first (40001, until this node has applied the other node's commit); any other error fails.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let mut again = h.inbox().pool().begin().await.unwrap();
        let refused = match h.inbox().enqueue(&mut again, keyed("first")).await {
            Ok(()) => match again.commit().await {
                Ok(()) => break,
                Err(error) => error,
            },
            Err(InboxError::Database { source, .. }) => source,
            Err(other) => panic!("the redelivery failed: {other:?}"),
        };
        let code = refused.as_database_error().and_then(|e| e.code());
        assert_eq!(code.as_deref(), Some("40001"), "{refused:?}");
        assert!(tokio::time::Instant::now() < deadline, "{refused:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        drained_payloads(&h).await,
        [b"second".to_vec(), b"first".to_vec()]
    );
}

/// The inboxes of one harness on nodes 1, 2 and 3.
fn inboxes(h: &MySqlHarness) -> [Inbox<sqlx::MySql>; 3] {
    [
        h.inbox.clone(),
        Inbox::new(h.node_pool(1, 10, false)),
        Inbox::new(h.node_pool(2, 10, false)),
    ]
}

/// What became of one delivery, in words, for the tallies the tests print.
fn kind<T: std::fmt::Debug>(outcome: &Result<Handled<T>, Error<support::TestError>>) -> String {
    match outcome {
        Ok(Handled::Processed(_)) => "processed".into(),
        Ok(Handled::Duplicate { .. }) => "duplicate".into(),
        Err(Error::Inbox(InboxError::Database { stage, source, .. })) => format!(
            "{stage:?}: {}",
            source
                .as_database_error()
                .and_then(|e| e.code())
                .unwrap_or_default()
        ),
        Err(Error::Transient(_)) => "transient in the body".into(),
        Err(Error::Inbox(InboxError::FingerprintMismatch { .. })) => "fingerprint mismatch".into(),
        Err(other) => format!("{other}"),
    }
}

/// Delivers `msg` until the outcome is not a retryable error, as a broker redelivering it would.
async fn until_settled(h: &MySqlHarness, inbox: &Inbox<sqlx::MySql>, msg: &Delivery) -> Outcome {
    for _ in 0..50 {
        match h.deliver_on(inbox, Consumer::Orders, msg).await {
            Err(error) if error.is_retryable() => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            outcome => return outcome,
        }
    }
    panic!("{} never settled", msg.label);
}

/// Two copies of one message claimed at the same moment on two nodes: both claims succeed, each on
/// its own node (neither waits for the other); both bodies run; the two commits go out together.
/// Exactly one commits. The other's commit is refused by the cluster (error 1213 at
/// `Stage::Commit`: its certification failed, or the winner's write-set aborted it just before),
/// retryable, with nothing of it committed; its retry is a duplicate. Repeated, so that both ways
/// of losing show up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_claimed_on_two_nodes_at_once_have_one_effect() {
    let h = MySqlHarness::on_galera().await;
    let [one, two, _] = inboxes(&h);
    let mut losers = BTreeMap::<String, usize>::new();
    for round in 0..20 {
        let label = format!("two-nodes-{round}");
        let key = message_key(&label).unwrap();
        let mut first = one
            .claim("orders", &key)
            .await
            .unwrap()
            .expect("node 1 claims");
        let mut second = two
            .claim("orders", &key)
            .await
            .unwrap()
            .expect("node 2 claims");
        for (claimed, consumer) in [(&mut first, "node-1"), (&mut second, "node-2")] {
            sqlx::query("INSERT INTO effects (consumer, label) VALUES (?, ?)")
                .bind(consumer)
                .bind(&label)
                .execute(claimed.connection())
                .await
                .unwrap();
        }
        let (a, b) = tokio::join!(first.commit(), second.commit());
        let (won, lost) = match (a, b) {
            (Ok(()), Err(lost)) => ("node-1", lost),
            (Err(lost), Ok(())) => ("node-2", lost),
            other => panic!("round {round}: expected one commit, got {other:?}"),
        };
        let InboxError::Database { stage, source, .. } = &lost else {
            panic!("round {round}: {lost:?}");
        };
        assert_eq!(*stage, Stage::Commit, "round {round}: {lost:?}");
        assert!(lost.is_retryable(), "round {round}: {lost:?}");
        let code = source.as_database_error().and_then(|e| e.code());
        *losers
            .entry(format!("{stage:?} {}", code.unwrap_or_default()))
            .or_default() += 1;
        h.sync_nodes().await;
        assert_eq!(h.effects_of(won, &label).await, 1, "round {round}");
        let loser = if won == "node-1" { "node-2" } else { "node-1" };
        assert_eq!(h.effects_of(loser, &label).await, 0, "round {round}");
        for inbox in [&one, &two] {
            let retry = inbox.claim("orders", &key).await.unwrap();
            assert!(retry.is_none(), "round {round}: the retry claimed again");
        }
    }
    println!("the losing commits: {losers:?}");
    assert_eq!(h.inbox_rows().await, 20);
}

/// A claim held open on node 1 does not make a delivery on node 2 wait (as it would on one node):
/// node 2 processes the message and commits; node 1's transaction, whose claim and body's work are
/// still open, is rolled back by the cluster when node 2's write-set reaches it, and its commit
/// reports that at `Stage::Commit`, retryable. The effect happened once, on node 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_on_another_node_does_not_wait_and_the_open_one_loses() {
    let h = MySqlHarness::on_galera().await;
    let [one, two, _] = inboxes(&h);
    let msg = Delivery::new("held-elsewhere");
    let key = message_key(&msg.message_id).unwrap();
    let mut held = one.claim("orders", &key).await.unwrap().unwrap();
    sqlx::query("INSERT INTO effects (consumer, label) VALUES ('held', ?)")
        .bind(&msg.label)
        .execute(held.connection())
        .await
        .unwrap();
    let elsewhere = tokio::time::timeout(
        Duration::from_secs(10),
        h.deliver_on(&two, Consumer::Orders, &msg),
    )
    .await
    .expect("the delivery on node 2 waited for node 1's claim");
    assert!(
        matches!(elsewhere, Ok(Handled::Processed(()))),
        "{elsewhere:?}"
    );
    let error = held.commit().await.unwrap_err();
    assert!(
        matches!(
            error,
            InboxError::Database {
                stage: Stage::Commit,
                ..
            }
        ),
        "{error:?}"
    );
    assert!(error.is_retryable(), "{error:?}");
    h.sync_nodes().await;
    assert_eq!(h.effects_of("orders", "held-elsewhere").await, 1);
    assert_eq!(h.effects_of("held", "held-elsewhere").await, 0);
    let retry = h.deliver(Consumer::Orders, &msg).await.unwrap();
    assert!(retry.is_duplicate(), "{retry:?}");
}

/// Thirty copies of each of twenty messages, delivered at once, ten on each node, each redelivered
/// while its outcome is a retryable error: every message has its effect exactly once, and every
/// copy but one ends as a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_spread_over_three_nodes_have_one_effect() {
    let h = MySqlHarness::on_galera().await;
    let nodes = inboxes(&h);
    let mut tally = BTreeMap::<String, usize>::new();
    for round in 0..20 {
        let msg = Delivery::new(&format!("spread-{round}"));
        let first = futures::future::join_all((0..30).map(|i| {
            let inbox = &nodes[i % 3];
            let msg = &msg;
            let h = &h;
            async move { h.deliver_on(inbox, Consumer::Orders, msg).await }
        }))
        .await;
        for outcome in &first {
            *tally.entry(kind(outcome)).or_default() += 1;
        }
        let mut processed = 0;
        for (i, outcome) in first.into_iter().enumerate() {
            let outcome = match outcome {
                Err(error) if error.is_retryable() => until_settled(&h, &nodes[i % 3], &msg).await,
                outcome => outcome,
            };
            match outcome {
                Ok(Handled::Processed(())) => processed += 1,
                Ok(Handled::Duplicate { .. }) => {}
                other => panic!("{}: {other:?}", msg.label),
            }
        }
        assert_eq!(processed, 1, "{}", msg.label);
        assert_eq!(h.effects(&msg.label).await, 1, "{}", msg.label);
    }
    println!("first outcomes of 600 copies: {tally:?}");
}

/// A body still running on node 1 when node 2 commits the same message: node 1's transaction is
/// aborted under the body, whose next statement fails with 1213 (`Error::Transient`, retryable)
/// or, if the body had finished, whose commit is refused; nothing of it is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_on_the_losing_node_is_rolled_back_with_its_claim() {
    use std::sync::Arc;
    use tokio::sync::Notify;

    let h = MySqlHarness::on_galera().await;
    let [one, two, _] = inboxes(&h);
    let key = message_key("slow-body").unwrap();
    let started = Arc::new(Notify::new());
    let mut held = one.claim("orders", &key).await.unwrap().unwrap();
    let slow = async {
        sqlx::query("INSERT INTO effects (consumer, label) VALUES ('slow', 'slow-body')")
            .execute(held.connection())
            .await?;
        started.notify_one();
        tokio::time::sleep(Duration::from_millis(500)).await;
        sqlx::query("INSERT INTO effects (consumer, label) VALUES ('slow-after', 'slow-body')")
            .execute(held.connection())
            .await
    };
    let fast = async {
        started.notified().await;
        h.deliver_on(&two, Consumer::Orders, &Delivery::new("slow-body"))
            .await
    };
    let (slow, fast) = tokio::join!(slow, fast);
    assert!(matches!(fast, Ok(Handled::Processed(()))), "{fast:?}");
    let error = slow.expect_err("the body's statement after the other node's commit succeeded");
    assert!(idempotent::is_retryable(&error), "{error:?}");
    let code = error.as_database_error().and_then(|e| e.code());
    assert_eq!(code.as_deref(), Some("40001"), "{error:?}");
    held.rollback().await;
    h.sync_nodes().await;
    assert_eq!(h.effects_of("slow", "slow-body").await, 0);
    assert_eq!(h.effects_of("slow-after", "slow-body").await, 0);
    assert_eq!(h.effects_of("orders", "slow-body").await, 1);
}

/// The stored response of a message committed on node 1, asked for on node 2 at once: the claim
/// on node 2 either finds the row (it was applied there), and then reads the response from the
/// same row on the same connection, or does not, inserts, and loses at its commit (retryable), and
/// the retry finds the row. Never a second effect, never a duplicate without its response: the
/// response is read from the row the claim found, not from a snapshot of another moment. Same for
/// a payload fingerprint: a reused key is a mismatch, or retryable and then a mismatch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_responses_and_fingerprints_read_on_another_node_are_never_stale() {
    let h = MySqlHarness::on_galera().await;
    let [one, two, _] = inboxes(&h);
    let mut tally = BTreeMap::<String, usize>::new();
    for round in 0..40 {
        let msg = Delivery::new(&format!("quote-{round}"));
        let first = h.deliver_quote_on(&one, &msg).await.unwrap();
        assert!(first.is_processed());
        let mut outcome = h.deliver_quote_on(&two, &msg).await;
        *tally
            .entry(format!("response: {}", kind(&outcome)))
            .or_default() += 1;
        while matches!(&outcome, Err(e) if e.is_retryable()) {
            outcome = h.deliver_quote_on(&two, &msg).await;
        }
        match outcome {
            Ok(Handled::Duplicate { response, .. }) => {
                assert_eq!(response, Some(format!("quote for quote-{round}")))
            }
            other => panic!("round {round}: {other:?}"),
        }

        let payment = Delivery::new(&format!("pay-{round}")).with_id(format!("payment-{round}"));
        assert!(
            h.deliver_payment_on(&one, &payment)
                .await
                .unwrap()
                .is_processed()
        );
        let reused = Delivery::new(&format!("other-{round}")).with_id(format!("payment-{round}"));
        let mut outcome = h.deliver_payment_on(&two, &reused).await;
        *tally
            .entry(format!("fingerprint: {}", kind(&outcome)))
            .or_default() += 1;
        while matches!(&outcome, Err(e) if e.is_retryable()) {
            outcome = h.deliver_payment_on(&two, &reused).await;
        }
        assert!(
            matches!(
                outcome,
                Err(Error::Inbox(InboxError::FingerprintMismatch { .. }))
            ),
            "round {round}: {outcome:?}"
        );
    }
    println!("the second node's first answers: {tally:?}");
    for round in 0..40 {
        assert_eq!(h.effects(&format!("quote-{round}")).await, 1);
        assert_eq!(h.effects(&format!("other-{round}")).await, 0);
    }
}

/// `is_processed` is a plain read: on another node, right after a commit, it can miss the row
/// until that node has applied it. With `wsrep_sync_wait` on the session (here set by the pool's
/// `after_connect`), the node first applies what the cluster committed: the read never misses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn is_processed_on_another_node_is_causal_with_wsrep_sync_wait() {
    let h = MySqlHarness::on_galera().await;
    let [one, plain, _] = inboxes(&h);
    let causal_two = Inbox::new(h.node_pool(1, 2, true));
    let mut stale = 0;
    for round in 0..200 {
        let msg = Delivery::new(&format!("seen-{round}"));
        assert!(
            h.deliver_on(&one, Consumer::Orders, &msg)
                .await
                .unwrap()
                .is_processed()
        );
        let (seen_plain, seen_causal) = tokio::join!(
            plain.is_processed("orders", &msg.message_id),
            causal_two.is_processed("orders", &msg.message_id)
        );
        assert!(
            seen_causal.unwrap(),
            "round {round}: a causal read missed a commit"
        );
        if !seen_plain.unwrap() {
            stale += 1;
        }
    }
    println!("plain reads on node 2 that missed node 1's commit: {stale} of 200");
    let mut conn = h.nodes[1].connect_with_causal().await;
    let level: u64 = sqlx::query_scalar("SELECT @@SESSION.wsrep_sync_wait")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(level, 15);
}

trait ConnectCausal {
    async fn connect_with_causal(&self) -> sqlx::MySqlConnection;
}

impl ConnectCausal for sqlx::mysql::MySqlConnectOptions {
    async fn connect_with_causal(&self) -> sqlx::MySqlConnection {
        use sqlx::ConnectOptions;
        let mut conn = self.connect().await.unwrap();
        causal(&mut conn).await.unwrap();
        conn
    }
}

/// The purger's lock (`GET_LOCK`) is a node's own: Galera does not replicate it, so purgers on two
/// nodes purge at once. Their batches delete the same oldest rows, and the cluster lets one of two
/// conflicting batches commit: the other purge fails with a retryable error (the background purger
/// logs it and tries again at its next interval), or both go through. Expired rows end up deleted,
/// younger ones are kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purgers_on_two_nodes_purge_at_once_and_lose_nothing() {
    const DAY: Duration = Duration::from_secs(24 * 60 * 60);
    let h = MySqlHarness::on_galera().await;
    let [one, two, _] = inboxes(&h);
    h.bulk_rows("old", 4000).await;
    h.backdate("old", 30 * DAY).await;
    for i in 0..10 {
        let msg = Delivery::new(&format!("young-{i}"));
        assert!(
            h.deliver(Consumer::Orders, &msg)
                .await
                .unwrap()
                .is_processed()
        );
    }
    let (a, b) = tokio::join!(one.purge_expired(100), two.purge_expired(100));
    let mut deleted = 0;
    let mut both_ran = true;
    for report in [a, b] {
        match report {
            Ok(report) => {
                both_ran &= !report.locked_elsewhere;
                deleted += report.deleted;
            }
            Err(error) => assert!(error.is_retryable(), "{error:?}"),
        }
    }
    assert!(both_ran, "a node saw the other node's purger lock");
    assert!(deleted <= 4000, "{deleted}");
    h.sync_nodes().await;
    let again = one.purge_expired(1000).await.unwrap();
    h.sync_nodes().await;
    assert_eq!(
        h.inbox_rows().await,
        10,
        "deleted {deleted}, then {}",
        again.deleted
    );
}
