//! The delay queues of a runner's retries: one per delay of its policy, named after it.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::broker::retry::RetryPolicy;

/// The delays of a policy's retries, one delay queue each: at most 100, the last of them the
/// longest (a later retry goes to the longest queue not longer than its delay).
pub(super) fn retry_delays(policy: &RetryPolicy) -> BTreeSet<Duration> {
    let mut delays = BTreeSet::new();
    for attempt in 1..policy.max_attempts {
        let delay = policy.delay_after(attempt);
        delays.insert(delay);
        if delay >= policy.max_delay || delays.len() >= 100 {
            break;
        }
    }
    delays
}

/// The delay queue of `queue`'s retries after `delay`.
pub(super) fn retry_queue(queue: &str, delay: Duration) -> String {
    format!("{queue}.retry.{}ms", delay.as_millis())
}

/// Whether `name` is one of `queue`'s delay queues (`<queue>.retry.<n>ms`).
pub(super) fn is_retry_queue(queue: &str, name: &[u8]) -> bool {
    name.strip_prefix(queue.as_bytes())
        .and_then(|rest| rest.strip_prefix(b".retry."))
        .and_then(|rest| rest.strip_suffix(b"ms"))
        .is_some_and(|digits| !digits.is_empty() && digits.iter().all(u8::is_ascii_digit))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delay_queues_are_recognised_by_name() {
        assert!(is_retry_queue("q", b"q.retry.100ms"));
        assert!(!is_retry_queue("q", b"q.retry.ms"));
        assert!(!is_retry_queue("q", b"q.dead"));
        assert!(!is_retry_queue("q", b"other.retry.100ms"));
        assert!(!is_retry_queue("q", b"q.retry.1x0ms"));
    }

    #[test]
    fn a_policy_of_any_size_has_few_delay_queues() {
        let policy = RetryPolicy::new(u32::MAX, Duration::from_millis(1)).multiplier(1.0001);
        let delays = retry_delays(&policy);
        assert!(!delays.is_empty() && delays.len() <= 100);
        let policy =
            RetryPolicy::new(100, Duration::from_secs(1)).max_delay(Duration::from_secs(4));
        let delays: Vec<u64> = retry_delays(&policy).iter().map(|d| d.as_secs()).collect();
        assert_eq!(delays, [1, 2, 4]);
    }
}
