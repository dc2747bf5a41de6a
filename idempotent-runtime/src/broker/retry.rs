//! The retry policy: how often, and how far apart, a failed delivery is tried again.

use std::time::Duration;

/// How often, and how far apart, a delivery that failed with a retryable error is tried again.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Attempts in all, the first delivery included (default 5). The last one's retryable error
    /// dead-letters the message.
    pub max_attempts: u32,
    /// The delay before the second attempt (default 1 s).
    pub first_delay: Duration,
    /// Each further delay is the one before times this (default 2).
    pub multiplier: f64,
    /// No delay is longer than this (default 5 minutes).
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            first_delay: Duration::from_secs(1),
            multiplier: 2.0,
            max_delay: Duration::from_secs(300),
        }
    }
}

impl RetryPolicy {
    /// Creates a policy of `max_attempts` attempts, the first retry after `first_delay`, each later
    /// one twice as late.
    pub fn new(max_attempts: u32, first_delay: Duration) -> Self {
        Self {
            max_attempts: max_attempts.max(1),
            first_delay,
            ..Self::default()
        }
    }

    /// Returns the same policy with another multiplier.
    pub fn multiplier(self, multiplier: f64) -> Self {
        Self { multiplier, ..self }
    }

    /// Returns the same policy with another longest delay.
    pub fn max_delay(self, max_delay: Duration) -> Self {
        Self { max_delay, ..self }
    }

    /// Returns how long to wait before attempt `attempt + 1`, after attempt `attempt` (counting
    /// from 1) failed: `first_delay` times `multiplier` to the power `attempt - 1`, and never more
    /// than `max_delay`. Any input gives an answer (no overflow, no panic), and the answers never
    /// shrink as `attempt` grows.
    pub fn delay_after(&self, attempt: u32) -> Duration {
        // NaN and anything below 1 count as 1 (`max` ignores NaN): delays never shrink.
        let multiplier = self.multiplier.max(1.0);
        let exponent = i32::try_from(attempt.saturating_sub(1)).unwrap_or(i32::MAX);
        let (first, longest) = (self.first_delay, self.max_delay);
        if exponent == 0 || first.is_zero() {
            return first.min(longest);
        }
        // Capped before it becomes a `Duration`: a factor of 2^70 (or infinity) must not overflow.
        let seconds = first.as_secs_f64() * multiplier.powi(exponent);
        if seconds.is_nan() || seconds >= longest.as_secs_f64() {
            return longest;
        }
        // Never below the first delay, which the float's rounding could reach.
        Duration::try_from_secs_f64(seconds).map_or(longest, |delay| delay.max(first).min(longest))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sixty_six_attempts_and_more_have_capped_delays() {
        let longest = Duration::from_secs(60);
        for attempts in [66, 100, 1_000, u32::MAX] {
            let policy = RetryPolicy::new(attempts, Duration::from_secs(1)).max_delay(longest);
            for attempt in [1, 64, 65, 66, 1_000, u32::MAX] {
                assert!(policy.delay_after(attempt) <= longest);
            }
            assert_eq!(policy.delay_after(attempts - 1), longest);
        }
    }

    #[test]
    fn delays_grow_and_stop_at_the_longest() {
        let policy = RetryPolicy::new(10, Duration::from_secs(1)).max_delay(Duration::from_secs(5));
        let delays: Vec<u64> = (1..6).map(|n| policy.delay_after(n).as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 5, 5]);
    }
}
