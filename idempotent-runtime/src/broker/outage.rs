//! A runner's view of its broker's availability: lost, reconnecting, back.

use std::sync::Arc;
use std::time::Duration;

use super::backoff::Backoff;
use super::error::ErrorChain;
use super::stats::Counters;

/// A runner's view of its broker's availability: it says once, at `warn`, that the broker was
/// lost, waits a capped, jittered back-off between attempts to get it back, and says at `info`
/// when it is back (counted in [`RunnerStats::reconnects`](super::RunnerStats::reconnects) and the
/// [`idempotent_runner_reconnects_total`](crate::metrics::RUNNER_RECONNECTS) counter).
pub(crate) struct Outage {
    broker: &'static str,
    source: String,
    /// Where reconnects are counted; `None` where another watch counts them.
    counters: Option<Arc<Counters>>,
    backoff: Backoff,
    since: Option<std::time::Instant>,
}

impl Outage {
    /// Waits from 100 ms, doubling, up to 5 s between attempts.
    const FIRST: Duration = Duration::from_millis(100);
    const LONGEST: Duration = Duration::from_secs(5);

    pub(crate) fn new(
        broker: &'static str,
        source: String,
        counters: Option<Arc<Counters>>,
    ) -> Self {
        Self {
            broker,
            source,
            counters,
            backoff: Backoff::new(Self::FIRST, Self::LONGEST),
            since: None,
        }
    }

    /// Notes that the broker failed with `error`; returns how long to wait before trying again.
    pub(crate) fn failed(&mut self, error: &(dyn std::error::Error + 'static)) -> Duration {
        let after = self.backoff.next();
        if self.since.is_none() {
            self.since = Some(std::time::Instant::now());
            tracing::warn!(
                broker = self.broker,
                source = %self.source,
                error = %ErrorChain(error),
                "lost the broker; reconnecting"
            );
        } else {
            tracing::debug!(broker = self.broker, source = %self.source, error = %ErrorChain(error), ?after, "the broker is still away");
        }
        after
    }

    /// Notes that the broker answers again.
    pub(crate) fn restored(&mut self) {
        self.backoff.reset();
        if let Some(since) = self.since.take() {
            if let Some(counters) = &self.counters {
                counters.count_reconnect();
                crate::metrics::runner_reconnected(self.broker, &self.source);
            }
            tracing::info!(
                broker = self.broker,
                source = %self.source,
                away = ?since.elapsed(),
                "reconnected to the broker"
            );
        }
    }
}
