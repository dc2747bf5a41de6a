//! Exponential back-off, capped and jittered.

use std::time::Duration;

use super::retry::RetryPolicy;

/// Exponential back-off, capped, with some jitter so that runners that lost one broker together do
/// not all come back at the same instant.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    first: Duration,
    longest: Duration,
    failures: u32,
}

impl Backoff {
    pub(crate) const fn new(first: Duration, longest: Duration) -> Self {
        Self {
            first,
            longest,
            failures: 0,
        }
    }

    /// The wait after one more failure.
    pub(crate) fn next(&mut self) -> Duration {
        let delay = RetryPolicy {
            max_attempts: u32::MAX,
            first_delay: self.first,
            multiplier: 2.0,
            max_delay: self.longest,
        }
        .delay_after(self.failures.saturating_add(1));
        self.failures = self.failures.saturating_add(1);
        jitter(delay)
    }

    pub(crate) fn reset(&mut self) {
        self.failures = 0;
    }
}

/// `delay` give or take a quarter.
fn jitter(delay: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(std::time::Instant::now().elapsed().as_nanos());
    let unit = (hasher.finish() % 1_000) as f64 / 1_000.0; // [0, 1)
    delay.mul_f64(0.75 + unit / 2.0)
}
