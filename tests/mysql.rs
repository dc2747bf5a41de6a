//! The conformance suite on MySQL or MariaDB (`IDEMPOTENT_MYSQL_URL`), a fresh database per test.
#![cfg(feature = "mysql")]

mod conformance;
mod support;

use conformance::conformance_tests;
use support::mysql::MySqlHarness;

conformance_tests!(MySqlHarness::new().await);
