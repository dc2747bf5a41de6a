//! The conformance suite on PostgreSQL (`IDEMPOTENT_PG_URL`), a fresh schema per test: with the
//! claim sent together with its `BEGIN` (the default), and in a statement of its own.
#![cfg(feature = "postgres")]

mod conformance;
mod support;

use conformance::conformance_tests;
use support::postgres::PgHarness;

conformance_tests!(PgHarness::new().await);

mod separate_claim {
    use super::*;

    conformance_tests!(PgHarness::new().await.with_separate_claim());
}
