//! The conformance suite on PostgreSQL (`IDEMPOTENT_PG_URL`), a fresh schema per test.
#![cfg(feature = "postgres")]

mod conformance;
mod support;

use conformance::conformance_tests;
use support::postgres::PgHarness;

conformance_tests!(PgHarness::new().await);
