//! The conformance suite on SQLite, a fresh database file per test.
#![cfg(feature = "sqlite")]

mod conformance;
mod support;

use conformance::conformance_tests;
use support::sqlite::SqliteHarness;

conformance_tests!(SqliteHarness::new().await);
