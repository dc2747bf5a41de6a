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
//! | [`idempotent_purged_rows_total`](PURGED) | counter | `table`, `kind` | rows deleted by purges: `kind` is `inbox`, `calls`, `audit`, `outbox` (sent outgoing messages) or `outbox_keys` |
//! | [`idempotent_outbox_published_total`](OUTBOX_PUBLISHED) | counter | `table` | outgoing messages a relay published and marked sent (the broker confirmed them) |
//! | [`idempotent_outbox_retried_total`](OUTBOX_RETRIED) | counter | `table`, `reason` | publications that failed and will be tried again: `rejected` (the broker refused the message; counts as an attempt) or `unavailable` (the broker could not be reached or did not confirm) |
//! | [`idempotent_outbox_parked_total`](OUTBOX_PARKED) | counter | `table` | outgoing messages parked after their last attempt |
//! | [`idempotent_outbox_backlog`](OUTBOX_BACKLOG) | gauge | `table` | outgoing messages committed and not yet sent (parked ones not counted), sampled by a relay |
//! | [`idempotent_outbox_oldest_unsent_seconds`](OUTBOX_OLDEST) | gauge | `table` | the age of the oldest of them (0 when there is none) |
//! | [`idempotent_outbox_delay_seconds`](OUTBOX_DELAY) | histogram | `table` | from an outgoing message's write to the broker's confirmation |
//! | [`idempotent_runner_reconnects_total`](RUNNER_RECONNECTS) | counter | `broker`, `source` | times a broker runner got its broker back after losing it: `broker` is `rabbitmq` or `nats`, `source` the queue or the JetStream consumer (`<stream>/<consumer>`) |
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
/// Rows deleted by purges, by `table` and `kind` (`inbox`, `calls`, `audit`, `outbox`,
/// `outbox_keys`).
pub const PURGED: &str = "idempotent_purged_rows_total";
/// Outgoing messages published and marked sent, by `table`.
pub const OUTBOX_PUBLISHED: &str = "idempotent_outbox_published_total";
/// Failed publications to be tried again, by `table` and `reason` (`rejected`, `unavailable`).
pub const OUTBOX_RETRIED: &str = "idempotent_outbox_retried_total";
/// Outgoing messages parked after their last attempt, by `table`.
pub const OUTBOX_PARKED: &str = "idempotent_outbox_parked_total";
/// Outgoing messages committed and not yet sent, by `table`.
pub const OUTBOX_BACKLOG: &str = "idempotent_outbox_backlog";
/// The age of the oldest unsent outgoing message (seconds), by `table`.
pub const OUTBOX_OLDEST: &str = "idempotent_outbox_oldest_unsent_seconds";
/// From an outgoing message's write to the broker's confirmation (seconds), by `table`.
pub const OUTBOX_DELAY: &str = "idempotent_outbox_delay_seconds";
/// Times a broker runner got its broker back after losing it, by `broker` and `source`.
pub const RUNNER_RECONNECTS: &str = "idempotent_runner_reconnects_total";

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
    ::metrics::describe_counter!(
        OUTBOX_PUBLISHED,
        "Outgoing messages the broker confirmed and a relay marked sent"
    );
    ::metrics::describe_counter!(
        OUTBOX_RETRIED,
        "Failed publications of outgoing messages, to be tried again, by reason"
    );
    ::metrics::describe_counter!(
        OUTBOX_PARKED,
        "Outgoing messages parked after their last attempt"
    );
    ::metrics::describe_gauge!(
        OUTBOX_BACKLOG,
        "Outgoing messages committed and not yet sent"
    );
    ::metrics::describe_gauge!(
        OUTBOX_OLDEST,
        ::metrics::Unit::Seconds,
        "Age of the oldest outgoing message not yet sent"
    );
    ::metrics::describe_counter!(
        RUNNER_RECONNECTS,
        "Times a broker runner got its broker back after losing it"
    );
    ::metrics::describe_histogram!(
        OUTBOX_DELAY,
        ::metrics::Unit::Seconds,
        "Time from an outgoing message's write to the broker's confirmation"
    );
}

/// Counts a reconnect of a broker runner of `source` (a queue, a consumer) to `broker`.
#[cfg_attr(
    not(any(
        feature = "rabbitmq",
        feature = "nats",
        feature = "kafka",
        feature = "sqs"
    )),
    allow(dead_code)
)]
pub(crate) fn runner_reconnected(broker: &'static str, source: &str) {
    ::metrics::counter!(RUNNER_RECONNECTS, "broker" => broker, "source" => source.to_owned())
        .increment(1);
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
    Outbox,
    OutboxKeys,
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
    outbox_purged: AtomicU64,
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
    /// Sent outgoing messages deleted by purges, after the outbox's retention.
    pub outbox_purged: u64,
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
            Purged::Outbox => (&self.outbox_purged, "outbox"),
            Purged::OutboxKeys => {
                if n > 0 {
                    ::metrics::counter!(PURGED, "table" => table.to_owned(), "kind" => "outbox_keys")
                        .increment(n);
                }
                return;
            }
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
            outbox_purged: get(&self.outbox_purged),
        }
    }
}

/// What a relay records through the facade, for the outbox of `table`.
pub(crate) struct OutboxMetrics {
    table: String,
}

impl OutboxMetrics {
    pub(crate) fn new(table: &str) -> Self {
        Self {
            table: table.to_owned(),
        }
    }

    /// Counts `n` messages published and marked sent, and how long each took since its write.
    pub(crate) fn published(&self, delays: &[Duration]) {
        if delays.is_empty() {
            return;
        }
        ::metrics::counter!(OUTBOX_PUBLISHED, "table" => self.table.clone())
            .increment(delays.len() as u64);
        let histogram = ::metrics::histogram!(OUTBOX_DELAY, "table" => self.table.clone());
        for delay in delays {
            histogram.record(delay.as_secs_f64());
        }
    }

    /// Counts `n` failed publications to be tried again; `rejected` by the broker, or not.
    pub(crate) fn retried(&self, rejected: bool, n: u64) {
        if n > 0 {
            let reason = if rejected { "rejected" } else { "unavailable" };
            ::metrics::counter!(OUTBOX_RETRIED, "table" => self.table.clone(), "reason" => reason)
                .increment(n);
        }
    }

    /// Counts `n` messages parked.
    pub(crate) fn parked(&self, n: u64) {
        if n > 0 {
            ::metrics::counter!(OUTBOX_PARKED, "table" => self.table.clone()).increment(n);
        }
    }

    /// Records the backlog: `rows` unsent, the oldest `oldest` old.
    pub(crate) fn backlog(&self, rows: u64, oldest: Duration) {
        ::metrics::gauge!(OUTBOX_BACKLOG, "table" => self.table.clone()).set(rows as f64);
        ::metrics::gauge!(OUTBOX_OLDEST, "table" => self.table.clone()).set(oldest.as_secs_f64());
    }
}
