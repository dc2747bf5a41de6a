//! What a runner counted: [`RunnerStats`], and the live counters behind it.

use std::sync::atomic::{AtomicU64, Ordering};

use super::route::Route;

/// What a runner counted, since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunnerStats {
    /// Deliveries acknowledged after their handler processed them.
    pub processed: u64,
    /// Deliveries acknowledged as duplicates.
    pub duplicates: u64,
    /// Deliveries scheduled for another attempt.
    pub retried: u64,
    /// Deliveries dead-lettered.
    pub dead_lettered: u64,
    /// Deliveries handed back to the broker, to be delivered again after a back-off, because their
    /// retry or dead letter could not be published (refused, unroutable, not confirmed within the
    /// publish timeout, or the connection was lost).
    pub released: u64,
    /// Deliveries parked for an operator, holding back the rest of their partition (the Kafka
    /// runner's [`hold_partition_on_failure`](super::kafka::Runner::hold_partition_on_failure)),
    /// where they would have been dead-lettered.
    pub held: u64,
    /// Times the runner got its broker back after losing it (a reconnect).
    pub reconnects: u64,
}

/// The live counters behind [`RunnerStats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    processed: AtomicU64,
    duplicates: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    released: AtomicU64,
    held: AtomicU64,
    reconnects: AtomicU64,
}

impl Counters {
    /// Counts a delivery settled by `route`, which was a duplicate or not.
    pub(crate) fn count(&self, route: &Route, duplicate: bool) {
        let counter = match route {
            Route::Ack if duplicate => &self.duplicates,
            Route::Ack => &self.processed,
            Route::Retry { .. } => &self.retried,
            Route::DeadLetter { .. } => &self.dead_lettered,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a delivery handed back to the broker.
    pub(crate) fn count_released(&self) {
        self.released.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a delivery parked for an operator.
    pub(crate) fn count_held(&self) {
        self.held.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a reconnect.
    pub(crate) fn count_reconnect(&self) {
        self.reconnects.fetch_add(1, Ordering::Relaxed);
    }

    /// Returns what was counted so far.
    pub(crate) fn snapshot(&self) -> RunnerStats {
        RunnerStats {
            processed: self.processed.load(Ordering::Relaxed),
            duplicates: self.duplicates.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            released: self.released.load(Ordering::Relaxed),
            held: self.held.load(Ordering::Relaxed),
            reconnects: self.reconnects.load(Ordering::Relaxed),
        }
    }
}
