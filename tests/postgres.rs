//! The conformance suite on PostgreSQL (`IDEMPOTENT_PG_URL`), a fresh schema per test: with the
//! claim in a statement of its own (the default), and sent together with its `BEGIN`.
#![cfg(feature = "postgres")]

mod conformance;
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
