//! The conformance suite on SQLite: a fresh database file per test, and the in-memory inbox for
//! users' unit tests.
#![cfg(feature = "sqlite")]

mod conformance;
mod support;

use conformance::conformance_tests;
use support::sqlite::SqliteHarness;

conformance_tests!(SqliteHarness::new().await);

mod in_memory {
    use crate::conformance::conformance_tests;
    use crate::support::sqlite::SqliteHarness;

    conformance_tests!(SqliteHarness::in_memory().await);
}
