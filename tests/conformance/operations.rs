//! Operating an inbox, on every backend: the purge horizon that refuses a message older than what
//! was purged, the retention of call records and audit rows, inspecting and listing, stuck calls,
//! counts per consumer, forgetting a message on purpose, and schema upgrades.

use std::str::FromStr;
use std::time::{Duration, SystemTime};

use idempotent::schema::CURRENT_VERSION;
use idempotent::{
    CallStart, Claim, ClaimOptions, Cursor, Error, Handled, InboxError, Listing, message_key,
};

use crate::support::{Consumer, Delivery, Harness};

const DAY: Duration = Duration::from_secs(24 * 60 * 60);
/// 15 days in milliseconds, for moving the times of call records and audit rows back.
const FIFTEEN_DAYS_MS: i64 = 15 * 24 * 60 * 60 * 1000;

/// Whether `a` and `b` are within `slack` of each other.
fn near(a: SystemTime, b: SystemTime, slack: Duration) -> bool {
    let gap = a
        .duration_since(b)
        .or_else(|e| Ok::<_, ()>(e.duration()))
        .unwrap();
    gap <= slack
}

/// A message whose key is a UUIDv7 says when it was sent: purged, its redelivery is refused rather
/// than processed again; a new message, and one whose UUID carries no time, are processed.
pub async fn purged_message_with_a_uuid_v7_key_is_refused_not_run_again(h: impl Harness) {
    let now = SystemTime::now();
    let old = Delivery::new("old-event").sent(now - 15 * DAY);
    let processed = h.deliver(Consumer::Events, &old).await.unwrap();
    assert!(processed.is_processed(), "no horizon yet: {processed:?}");
    h.backdate("events", 15 * DAY).await;
    assert_eq!(h.inbox().purge_expired(100).await.unwrap().deleted, 1);

    let stats = h.inbox().stats().await.unwrap();
    let events = stats.iter().find(|s| s.consumer == "events").unwrap();
    let horizon = events.horizon.expect("the purge recorded a horizon");
    assert!(
        near(horizon, now - 14 * DAY, Duration::from_secs(60)),
        "{horizon:?}"
    );

    let error = h.deliver(Consumer::Events, &old).await.unwrap_err();
    match &error {
        Error::Inbox(InboxError::OlderThanHorizon {
            consumer,
            key,
            sent_at,
            horizon: refused_at,
        }) => {
            assert_eq!(consumer, "events");
            assert_eq!(key, &message_key(&old.uuid).unwrap());
            assert!(near(*sent_at, now - 15 * DAY, Duration::from_millis(1)));
            assert_eq!(*refused_at, horizon);
        }
        other => panic!("expected OlderThanHorizon, got {other:?}"),
    }
    assert!(
        !error.is_retryable(),
        "a refused message goes to the dead-letter queue"
    );
    assert_eq!(h.effects("old-event").await, 1, "the body ran again");
    assert!(!h.inbox().is_processed("events", &old.uuid).await.unwrap());

    let new = Delivery::new("new-event");
    assert!(
        h.deliver(Consumer::Events, &new)
            .await
            .unwrap()
            .is_processed()
    );
    let untimed = Delivery::new("v4-event").with_uuid(uuid::Uuid::new_v4());
    assert!(
        h.deliver(Consumer::Events, &untimed)
            .await
            .unwrap()
            .is_processed()
    );
    assert_eq!(h.inbox().metrics().older_than_horizon, 1);
    // Another consumer's horizon is its own.
    assert!(
        h.deliver(Consumer::Orders, &old)
            .await
            .unwrap()
            .is_processed()
    );
}

/// `sent_at = "sent_at"` names the send time; a message without one keeps the old behaviour; a
/// row still there is a duplicate however old its message; the clock-skew margin widens the
/// horizon.
pub async fn purged_message_with_a_send_time_field_is_refused_and_one_without_is_run_again(
    h: impl Harness,
) {
    let now = SystemTime::now();
    let old = Delivery::new("old-stamped").sent(now - 20 * DAY);
    assert!(
        h.deliver(Consumer::Stamped, &old)
            .await
            .unwrap()
            .is_processed()
    );
    h.backdate("stamped", 15 * DAY).await;
    // Processed now, though sent a month ago: its row outlives the purge.
    let kept = Delivery::new("kept-stamped").sent(now - 30 * DAY);
    assert!(
        h.deliver(Consumer::Stamped, &kept)
            .await
            .unwrap()
            .is_processed()
    );
    assert_eq!(h.inbox().purge_expired(100).await.unwrap().deleted, 1);

    let error = h.deliver(Consumer::Stamped, &old).await.unwrap_err();
    assert!(
        matches!(error, Error::Inbox(InboxError::OlderThanHorizon { .. })),
        "{error:?}"
    );
    // A row still there is a duplicate, however old the message says it is.
    assert!(
        h.deliver(Consumer::Stamped, &kept)
            .await
            .unwrap()
            .is_duplicate()
    );
    // Without a send time: the documented limit, processed again.
    let untimed = old.clone().with_sent_at(None);
    assert!(
        h.deliver(Consumer::Stamped, &untimed)
            .await
            .unwrap()
            .is_processed()
    );
    assert_eq!(h.effects("old-stamped").await, 2);

    // Sent 30 minutes after the horizon: inside the default margin of an hour, refused; with no
    // margin, processed.
    let close = Delivery::new("close-to-horizon").sent(now - 14 * DAY + Duration::from_secs(1800));
    let error = h.deliver(Consumer::Stamped, &close).await.unwrap_err();
    assert!(
        matches!(error, Error::Inbox(InboxError::OlderThanHorizon { .. })),
        "{error:?}"
    );
    let trusting = h.inbox().clone().with_clock_skew_margin(Duration::ZERO);
    assert_eq!(trusting.retention().skew_margin(), Duration::ZERO);
    let outcome = h.deliver_on(&trusting, Consumer::Stamped, &close).await;
    assert!(matches!(outcome, Ok(Handled::Processed(()))), "{outcome:?}");
}

/// Completed calls and pending calls whose lease ran out long ago are purged with the consumer's
/// retention; a pending call whose lease still runs, and recent calls, are kept.
pub async fn call_records_are_purged_with_the_retention(h: impl Harness) {
    let key = |k: &str| message_key(k).unwrap();
    let inbox = h.inbox();
    let ok = |value: &'static str| async move { Ok::<_, std::io::Error>(value.to_owned()) };
    let _: String = inbox
        .call_once(
            "ops",
            &key("done-old"),
            "charge",
            Duration::from_secs(30),
            |_| ok("a"),
        )
        .await
        .unwrap();
    let _: String = inbox
        .call_once(
            "ops-recent",
            &key("done-new"),
            "charge",
            Duration::from_secs(30),
            |_| ok("b"),
        )
        .await
        .unwrap();
    let started = inbox
        .begin_call::<String>(
            "ops",
            &key("stuck-old"),
            "charge",
            Duration::from_millis(50),
        )
        .await
        .unwrap();
    assert!(matches!(started, CallStart::Run(_)));
    let started = inbox
        .begin_call::<String>("ops", &key("live-old"), "charge", 30 * DAY)
        .await
        .unwrap();
    assert!(matches!(started, CallStart::Run(_)));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let moved = h
        .execute(&format!(
            "UPDATE idempotent_inbox_calls SET updated_at = updated_at - {FIFTEEN_DAYS_MS}, \
             lease_until = lease_until - {FIFTEEN_DAYS_MS} WHERE consumer = 'ops'"
        ))
        .await;
    assert_eq!(moved, 3);

    let preview = inbox.purge_preview().await.unwrap();
    assert_eq!(preview.len(), 1, "{preview:?}");
    assert_eq!((preview[0].consumer.as_str(), preview[0].calls), ("ops", 2));
    let report = inbox.purge_expired(1).await.unwrap();
    assert_eq!((report.deleted, report.calls_deleted), (0, 2), "{report:?}");
    assert_eq!(inbox.metrics().calls_purged, 2);

    // The purged completed call is gone: a new attempt runs it. The others are as they were.
    let again = inbox
        .begin_call::<String>("ops", &key("done-old"), "charge", Duration::from_secs(30))
        .await
        .unwrap();
    assert!(
        matches!(&again, CallStart::Run(lease) if lease.fence() == 1),
        "{again:?}"
    );
    let live = inbox
        .begin_call::<String>("ops", &key("live-old"), "charge", Duration::from_secs(30))
        .await;
    assert!(
        matches!(live, Err(InboxError::CallInProgress { .. })),
        "{live:?}"
    );
    let recent = inbox
        .begin_call::<String>(
            "ops-recent",
            &key("done-new"),
            "charge",
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    assert!(matches!(recent, CallStart::Completed(r) if r == "b"));
}

/// One message's record, and a consumer's records page by page.
pub async fn inspect_and_list_show_what_the_inbox_holds(h: impl Harness) {
    let before = SystemTime::now() - Duration::from_secs(60);
    assert!(
        h.deliver_quote(&Delivery::new("inspect-quote"))
            .await
            .unwrap()
            .is_processed()
    );
    let quote = h
        .inbox()
        .inspect("quotes", "inspect-quote")
        .await
        .unwrap()
        .expect("a processed message has a record");
    assert_eq!(quote.key, message_key("inspect-quote").unwrap());
    let stored = serde_json::to_vec("quote for inspect-quote").unwrap();
    assert_eq!(quote.response_len, Some(stored.len() as u64));
    assert_eq!(quote.fingerprint, None);
    assert!(near(
        quote.processed_at,
        SystemTime::now(),
        Duration::from_secs(60)
    ));

    assert!(
        h.deliver_payment(&Delivery::new("inspect-pay"))
            .await
            .unwrap()
            .is_processed()
    );
    let pay = h
        .inbox()
        .inspect("payments", "inspect-pay")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(pay.fingerprint.map(|f| f.len()), Some(32));
    assert_eq!(pay.response_len, None);
    assert_eq!(
        h.inbox().inspect("payments", "never-seen").await.unwrap(),
        None
    );

    for i in 0..25 {
        let msg = Delivery::new(&format!("list-{i:02}"));
        assert!(
            h.deliver(Consumer::Orders, &msg)
                .await
                .unwrap()
                .is_processed()
        );
    }
    let mut seen = Vec::new();
    let mut pages = Vec::new();
    let mut listing = Listing::new().limit(10);
    loop {
        let page = h.inbox().list("orders", listing.clone()).await.unwrap();
        pages.push(page.records.len());
        seen.extend(page.records.iter().map(|r| r.key.clone()));
        let Some(next) = page.next else { break };
        assert_eq!(Cursor::from_str(&next.to_string()).unwrap(), next);
        listing = listing.after(next);
    }
    assert_eq!(pages, [10, 10, 5]);
    let mut expected: Vec<_> = (0..25)
        .map(|i| message_key(&format!("list-{i:02}")).unwrap())
        .collect();
    let mut sorted = seen.clone();
    sorted.sort();
    expected.sort();
    assert_eq!(sorted, expected, "every record once");
    let times: Vec<_> = h
        .inbox()
        .list("orders", Listing::new())
        .await
        .unwrap()
        .records
        .iter()
        .map(|r| r.processed_at)
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "oldest first");
    let none_before = h
        .inbox()
        .list("orders", Listing::new().until(before))
        .await
        .unwrap();
    assert!(none_before.records.is_empty() && none_before.next.is_none());
    let later = SystemTime::now() + Duration::from_secs(3600);
    assert!(
        h.inbox()
            .list("orders", Listing::new().since(later))
            .await
            .unwrap()
            .records
            .is_empty()
    );
    assert_eq!(
        h.inbox()
            .list("orders", Listing::new().since(before))
            .await
            .unwrap()
            .records
            .len(),
        25
    );
}

/// Pending calls whose lease ran out are listed; counts per consumer add up.
pub async fn stuck_calls_and_stats_show_what_needs_a_look(h: impl Harness) {
    let key = |k: &str| message_key(k).unwrap();
    let inbox = h.inbox();
    let short = Duration::from_millis(50);
    assert!(matches!(
        inbox
            .begin_call::<String>("stats", &key("s-1"), "charge", short)
            .await
            .unwrap(),
        CallStart::Run(_)
    ));
    assert!(matches!(
        inbox
            .begin_call::<String>("stats", &key("s-2"), "charge", 30 * DAY)
            .await
            .unwrap(),
        CallStart::Run(_)
    ));
    let _: u32 = inbox
        .call_once("stats", &key("s-3"), "charge", short, |_| async {
            Ok::<_, std::io::Error>(3)
        })
        .await
        .unwrap();
    for label in ["stats-1", "stats-2"] {
        assert!(
            h.deliver(Consumer::Orders, &Delivery::new(label))
                .await
                .unwrap()
                .is_processed()
        );
    }
    tokio::time::sleep(Duration::from_millis(150)).await;

    let stuck = inbox.stuck_calls(None, 10).await.unwrap();
    assert_eq!(stuck.len(), 1, "{stuck:?}");
    assert_eq!(
        (
            stuck[0].consumer.as_str(),
            &stuck[0].key,
            stuck[0].name.as_str(),
            stuck[0].fence
        ),
        ("stats", &key("s-1"), "charge", 1)
    );
    assert!(stuck[0].expired_for > Duration::ZERO);
    assert_eq!(inbox.stuck_calls(Some("stats"), 10).await.unwrap().len(), 1);
    assert!(
        inbox
            .stuck_calls(Some("orders"), 10)
            .await
            .unwrap()
            .is_empty()
    );

    let stats = inbox.stats().await.unwrap();
    let of = |name: &str| stats.iter().find(|s| s.consumer == name).cloned().unwrap();
    let orders = of("orders");
    assert_eq!(
        (orders.rows, orders.pending_calls, orders.horizon),
        (2, 0, None)
    );
    assert!(near(
        orders.oldest.unwrap(),
        SystemTime::now(),
        Duration::from_secs(60)
    ));
    let calls = of("stats");
    assert_eq!(
        (calls.rows, calls.pending_calls, calls.stuck_calls),
        (0, 2, 1)
    );
}

/// `forget` deletes the row so that the message runs again, with an audit row written in the same
/// transaction and kept for the retention.
pub async fn forget_runs_a_message_again_and_leaves_an_audit_row(h: impl Harness) {
    let msg = Delivery::new("forget-me");
    assert!(
        h.deliver(Consumer::Orders, &msg)
            .await
            .unwrap()
            .is_processed()
    );
    for reason in ["", "   ", "a\0b"] {
        let error = h
            .inbox()
            .forget("orders", "forget-me", reason)
            .await
            .unwrap_err();
        assert!(matches!(error, InboxError::Reason { .. }), "{error:?}");
    }
    assert!(h.inbox().is_processed("orders", "forget-me").await.unwrap());

    let reason = "the VAT bug in the body is fixed (#123)";
    assert!(
        h.inbox()
            .forget("orders", "forget-me", reason)
            .await
            .unwrap()
    );
    assert!(!h.inbox().is_processed("orders", "forget-me").await.unwrap());
    assert!(
        h.deliver(Consumer::Orders, &msg)
            .await
            .unwrap()
            .is_processed()
    );
    assert_eq!(h.effects("forget-me").await, 2);
    assert!(
        !h.inbox()
            .forget("orders", "never-seen", "a typo")
            .await
            .unwrap()
    );

    let audit = h.inbox().audit(Some("orders"), 10).await.unwrap();
    assert_eq!(audit.len(), 1, "{audit:?}");
    let entry = &audit[0];
    assert_eq!(entry.consumer, "orders");
    assert_eq!(entry.reason, reason);
    assert_eq!(
        entry.key_digest,
        message_key("forget-me").unwrap().full_digest()
    );
    assert!(entry.processed_at.is_some());
    assert!(near(
        entry.forgotten_at,
        SystemTime::now(),
        Duration::from_secs(60)
    ));
    assert_eq!(h.inbox().audit(None, 10).await.unwrap(), audit);
    assert_eq!(h.inbox().metrics().forgotten, 1);

    h.execute(&format!(
        "UPDATE idempotent_inbox_audit SET forgotten_at = forgotten_at - {FIFTEEN_DAYS_MS}"
    ))
    .await;
    let report = h.inbox().purge_expired(100).await.unwrap();
    assert_eq!((report.deleted, report.audit_deleted), (0, 1), "{report:?}");
    assert!(h.inbox().audit(None, 10).await.unwrap().is_empty());
}

/// Tables made by the first release (created here with its DDL, and filled) are upgraded by
/// `migrate`, and nothing in them is lost: rows, responses, fingerprints, completed and pending
/// calls. A fresh table starts at the current version; migrating again does nothing.
pub async fn migrate_upgrades_the_first_release_tables_without_losing_rows(h: impl Harness) {
    h.create_legacy_tables("legacy_inbox").await;
    // On Galera the harness wrote on node 3 and the inbox migrates on node 1.
    h.writes_applied().await;
    let inbox = h.inbox().clone().with_table("legacy_inbox").unwrap();
    let migrated = inbox.migrate().await.unwrap();
    assert_eq!((migrated.from, migrated.to), (1, CURRENT_VERSION));

    let first = inbox
        .inspect("old-orders", "legacy-1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.fingerprint, Some(vec![7; 32]));
    assert_eq!(first.response_len, Some(6));
    assert!(inbox.is_processed("old-orders", "legacy-2").await.unwrap());
    let options = ClaimOptions {
        read_response: true,
        ..ClaimOptions::default()
    };
    match inbox
        .claim_with("old-orders", "legacy-1", options)
        .await
        .unwrap()
    {
        Claim::Duplicate { response } => assert_eq!(response.as_deref(), Some(&b"\"kept\""[..])),
        Claim::New(_) => panic!("an upgraded row was claimed again"),
    }
    let key = message_key("legacy-1").unwrap();
    let charged: String = inbox
        .call_once(
            "old-orders",
            &key,
            "charge",
            Duration::from_secs(30),
            |_| async { Err(std::io::Error::other("a completed call must not run again")) },
        )
        .await
        .unwrap();
    assert_eq!(charged, "ch_1");
    let refund = inbox
        .begin_call::<String>("old-orders", &key, "refund", Duration::from_secs(30))
        .await;
    assert!(
        matches!(refund, Err(InboxError::CallInProgress { .. })),
        "{refund:?}"
    );
    // The upgraded call records count from the upgrade: a purge keeps them.
    let report = inbox.purge_expired(100).await.unwrap();
    assert_eq!((report.deleted, report.calls_deleted), (0, 0), "{report:?}");
    // What version 2 adds works on the upgraded tables.
    assert!(
        inbox
            .forget("old-orders", "legacy-2", "after the upgrade")
            .await
            .unwrap()
    );
    assert_eq!(inbox.audit(None, 10).await.unwrap().len(), 1);

    let again = inbox.migrate().await.unwrap();
    assert_eq!((again.from, again.to), (CURRENT_VERSION, CURRENT_VERSION));
    let fresh = h.inbox().clone().with_table("fresh_inbox").unwrap();
    let created = fresh.migrate().await.unwrap();
    assert_eq!((created.from, created.to), (0, CURRENT_VERSION));
}

/// Tables of a newer schema than this library's are refused, with a clear error.
pub async fn migrate_refuses_a_schema_newer_than_the_library(h: impl Harness) {
    h.execute("INSERT INTO idempotent_inbox_schema (version, migrated_at) VALUES (99, 0)")
        .await;
    let error = h.inbox().migrate().await.unwrap_err();
    assert!(
        matches!(
            error,
            InboxError::SchemaTooNew {
                found: 99,
                supported: CURRENT_VERSION,
                ..
            }
        ),
        "{error:?}"
    );
    assert!(!error.is_retryable());
    assert!(error.to_string().contains("schema version 99"), "{error}");
    // The inbox itself still works for the handlers of the newer version's tables' callers.
    assert!(
        h.deliver(Consumer::Orders, &Delivery::new("still-there"))
            .await
            .unwrap()
            .is_processed()
    );
}
