//! What the inbox counts, and where it goes: through the [`metrics`](https://docs.rs/metrics)
//! facade, which the exporters of Prometheus, OpenTelemetry and others read, and into each inbox's
//! own counters ([`Inbox::metrics`](crate::Inbox::metrics)).
//!
//! The names and labels are stable; a recorder installed by the program receives them:
//!
//! | metric | kind | labels | what |
//! |---|---|---|---|
//! | [`idempotent_messages_total`](MESSAGES) | counter | `consumer`, `outcome` | messages handled, by outcome: `processed`, `duplicate`, `rolled_back` (a body error, a panic, a failed commit), `fingerprint_mismatch`, `older_than_horizon` |
//! | [`idempotent_claim_wait_seconds`](CLAIM_WAIT) | histogram | `consumer`, `outcome` | how long each claim took, from its `BEGIN` to the answer: the time it waited for an in-flight twin (or SQLite's write lock) shows here; `outcome` is `claimed` or `duplicate` |
//! | [`idempotent_calls_total`](CALLS) | counter | `consumer`, `outcome` | calls to outside services refused: `in_progress` (another attempt holds the lease), `fenced` (a late attempt's result refused) |
//! | [`idempotent_forgotten_total`](FORGOTTEN) | counter | `consumer` | messages forgotten on purpose ([`Inbox::forget`](crate::Inbox::forget)) |
//! | [`idempotent_purged_rows_total`](PURGED) | counter | `table`, `kind` | rows deleted by purges: `kind` is `inbox`, `calls` or `audit` |
//!
//! Nothing is recorded without a recorder (the facade's calls then cost next to nothing). Call
//! [`describe`] once after installing one to give the metrics their descriptions and units.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Messages handled, by `consumer` and `outcome`.
pub const MESSAGES: &str = "idempotent_messages_total";
/// How long claims took (seconds), by `consumer` and `outcome` (`claimed`, `duplicate`).
pub const CLAIM_WAIT: &str = "idempotent_claim_wait_seconds";
/// Calls to outside services refused, by `consumer` and `outcome` (`in_progress`, `fenced`).
pub const CALLS: &str = "idempotent_calls_total";
/// Messages forgotten on purpose, by `consumer`.
pub const FORGOTTEN: &str = "idempotent_forgotten_total";
/// Rows deleted by purges, by `table` and `kind` (`inbox`, `calls`, `audit`).
pub const PURGED: &str = "idempotent_purged_rows_total";

/// Describes the inbox's metrics to the installed recorder (descriptions and units). Call it once
/// after installing the recorder; recording works without it.
pub fn describe() {
    ::metrics::describe_counter!(
        MESSAGES,
        "Messages handled by an idempotent inbox, by outcome"
    );
    ::metrics::describe_histogram!(
        CLAIM_WAIT,
        ::metrics::Unit::Seconds,
        "Time a claim took from its BEGIN to the answer, including waits on in-flight duplicates"
    );
    ::metrics::describe_counter!(CALLS, "Calls to outside services refused, by outcome");
    ::metrics::describe_counter!(FORGOTTEN, "Messages forgotten on purpose");
    ::metrics::describe_counter!(PURGED, "Rows deleted by the purge, by kind");
}

/// What became of a message, as counted.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Outcome {
    Processed,
    Duplicate,
    RolledBack,
    FingerprintMismatch,
    OlderThanHorizon,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Processed => "processed",
            Outcome::Duplicate => "duplicate",
            Outcome::RolledBack => "rolled_back",
            Outcome::FingerprintMismatch => "fingerprint_mismatch",
            Outcome::OlderThanHorizon => "older_than_horizon",
        }
    }
}

/// A call to an outside service refused, as counted.
#[derive(Debug, Clone, Copy)]
pub(crate) enum CallOutcome {
    InProgress,
    Fenced,
}

/// What a purge deleted from, as counted.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Purged {
    Inbox,
    Calls,
    Audit,
}

/// The live counters, shared by an inbox and its clones.
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    processed: AtomicU64,
    duplicates: AtomicU64,
    rolled_back: AtomicU64,
    fingerprint_mismatches: AtomicU64,
    older_than_horizon: AtomicU64,
    calls_in_progress: AtomicU64,
    calls_fenced: AtomicU64,
    forgotten: AtomicU64,
    rows_purged: AtomicU64,
    calls_purged: AtomicU64,
    audit_purged: AtomicU64,
}

/// What an inbox counted, as returned by [`Inbox::metrics`](crate::Inbox::metrics): the same
/// events as the [metrics](self) the facade records, for this inbox and its clones only, without
/// labels (each field only grows).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MetricsSnapshot {
    /// Messages whose body ran and committed.
    pub processed: u64,
    /// Deliveries found to be duplicates.
    pub duplicates: u64,
    /// Claims rolled back: a body error, or a failed commit.
    pub rolled_back: u64,
    /// Duplicates whose payload fingerprint differed.
    pub fingerprint_mismatches: u64,
    /// Messages refused as older than their consumer's purge horizon.
    pub older_than_horizon: u64,
    /// Calls to outside services refused because another attempt held the lease.
    pub calls_in_progress: u64,
    /// Late attempts whose result was refused because a later attempt took the call over.
    pub calls_fenced: u64,
    /// Messages forgotten on purpose.
    pub forgotten: u64,
    /// Expired inbox rows deleted by purges.
    pub rows_purged: u64,
    /// Expired call records deleted by purges.
    pub calls_purged: u64,
    /// Expired audit rows deleted by purges.
    pub audit_purged: u64,
}

fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

impl Metrics {
    /// Counts `n` messages of `consumer` with `outcome`.
    pub(crate) fn message(&self, consumer: &str, outcome: Outcome, n: u64) {
        if n == 0 {
            return;
        }
        add(
            match outcome {
                Outcome::Processed => &self.processed,
                Outcome::Duplicate => &self.duplicates,
                Outcome::RolledBack => &self.rolled_back,
                Outcome::FingerprintMismatch => &self.fingerprint_mismatches,
                Outcome::OlderThanHorizon => &self.older_than_horizon,
            },
            n,
        );
        ::metrics::counter!(MESSAGES, "consumer" => consumer.to_owned(), "outcome" => outcome.label())
            .increment(n);
    }

    /// Records how long a claim of `consumer` took, and whether it claimed the key.
    pub(crate) fn claim_waited(&self, consumer: &str, claimed: bool, waited: Duration) {
        let outcome = if claimed { "claimed" } else { "duplicate" };
        ::metrics::histogram!(CLAIM_WAIT, "consumer" => consumer.to_owned(), "outcome" => outcome)
            .record(waited.as_secs_f64());
    }

    /// Counts a refused call of `consumer`.
    pub(crate) fn call(&self, consumer: &str, outcome: CallOutcome) {
        let (counter, label) = match outcome {
            CallOutcome::InProgress => (&self.calls_in_progress, "in_progress"),
            CallOutcome::Fenced => (&self.calls_fenced, "fenced"),
        };
        add(counter, 1);
        ::metrics::counter!(CALLS, "consumer" => consumer.to_owned(), "outcome" => label)
            .increment(1);
    }

    /// Counts a message of `consumer` forgotten on purpose.
    pub(crate) fn forgotten(&self, consumer: &str) {
        add(&self.forgotten, 1);
        ::metrics::counter!(FORGOTTEN, "consumer" => consumer.to_owned()).increment(1);
    }

    /// Counts `n` rows of `kind` deleted from `table`'s tables.
    pub(crate) fn purged(&self, table: &str, kind: Purged, n: u64) {
        let (counter, label) = match kind {
            Purged::Inbox => (&self.rows_purged, "inbox"),
            Purged::Calls => (&self.calls_purged, "calls"),
            Purged::Audit => (&self.audit_purged, "audit"),
        };
        add(counter, n);
        if n > 0 {
            ::metrics::counter!(PURGED, "table" => table.to_owned(), "kind" => label).increment(n);
        }
    }

    pub(crate) fn snapshot(&self) -> MetricsSnapshot {
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        MetricsSnapshot {
            processed: get(&self.processed),
            duplicates: get(&self.duplicates),
            rolled_back: get(&self.rolled_back),
            fingerprint_mismatches: get(&self.fingerprint_mismatches),
            older_than_horizon: get(&self.older_than_horizon),
            calls_in_progress: get(&self.calls_in_progress),
            calls_fenced: get(&self.calls_fenced),
            forgotten: get(&self.forgotten),
            rows_purged: get(&self.rows_purged),
            calls_purged: get(&self.calls_purged),
            audit_purged: get(&self.audit_purged),
        }
    }
}
