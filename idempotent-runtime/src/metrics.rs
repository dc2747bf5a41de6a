//! Counters a user can export: what the inbox saw, since the process started.

use std::sync::atomic::{AtomicU64, Ordering};

/// The live counters, shared by an inbox and its clones.
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    processed: AtomicU64,
    duplicates: AtomicU64,
    rolled_back: AtomicU64,
    fingerprint_mismatches: AtomicU64,
    calls_in_progress: AtomicU64,
    calls_fenced: AtomicU64,
    rows_purged: AtomicU64,
}

/// What an inbox counted, as returned by [`Inbox::metrics`](crate::Inbox::metrics); export it to
/// your metrics system (each field only grows).
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
    /// Calls to outside services refused because another attempt held the lease.
    pub calls_in_progress: u64,
    /// Late attempts whose result was refused because a later attempt took the call over.
    pub calls_fenced: u64,
    /// Expired rows deleted by purges.
    pub rows_purged: u64,
}

macro_rules! counters {
    ($($name:ident => $field:ident),* $(,)?) => {
        impl Metrics {
            $(pub(crate) fn $name(&self, n: u64) { self.$field.fetch_add(n, Ordering::Relaxed); })*

            pub(crate) fn snapshot(&self) -> MetricsSnapshot {
                MetricsSnapshot {
                    $($field: self.$field.load(Ordering::Relaxed),)*
                }
            }
        }
    };
}
counters! {
    processed => processed,
    duplicate => duplicates,
    rolled_back => rolled_back,
    fingerprint_mismatch => fingerprint_mismatches,
    call_in_progress => calls_in_progress,
    call_fenced => calls_fenced,
    purged => rows_purged,
}
