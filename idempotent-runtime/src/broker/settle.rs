//! Settling a delivery by its route, after the `before_settle` hook; a delivery whose retry or
//! dead letter the broker did not take goes back to it after a back-off of its own.

use std::sync::Arc;
use std::time::Duration;

use super::backoff::Backoff;
use super::delivery::Delivery;
use super::error::ErrorChain;
use super::message::Message;
use super::retry::RetryPolicy;
use super::route::Route;
use super::stats::Counters;
use tokio_util::sync::CancellationToken as Shutdown;

/// Called with each delivery's message and route once the outcome is known, before the runner
/// settles the delivery; see the runners' `before_settle`.
pub type BeforeSettle =
    Arc<dyn Fn(&Message, &Route) -> futures_util::future::BoxFuture<'static, ()> + Send + Sync>;

/// What a runner does with outcomes: its retry policy, its counters, and what it calls before it
/// settles a delivery.
pub(crate) struct Settler {
    pub(crate) policy: RetryPolicy,
    pub(crate) counters: Arc<Counters>,
    pub(crate) before: Option<BeforeSettle>,
    pub(crate) shutdown: Shutdown,
    /// The back-off of messages whose retry or dead letter could not be published.
    held: ReleaseBackoff,
}

impl Settler {
    /// Returns a settler with `policy`, counting in `counters`, calling `before` before it settles,
    /// and cutting its back-offs short at `shutdown`.
    pub(crate) fn new(
        policy: RetryPolicy,
        counters: Arc<Counters>,
        before: Option<BeforeSettle>,
        shutdown: Shutdown,
    ) -> Self {
        Self {
            policy,
            counters,
            before,
            shutdown,
            held: ReleaseBackoff::default(),
        }
    }

    /// Counts and settles `delivery` by `route` (`duplicate`: its message was one), after the
    /// hook, which sees its message. When the broker does not take the retry or dead letter, the
    /// delivery is handed back to the broker after a back-off of its own: nothing is lost, and the
    /// runner goes on.
    pub(crate) async fn settle<D: Delivery>(
        &self,
        delivery: D,
        message: Option<&Message>,
        route: Route,
        duplicate: bool,
    ) {
        if let (Some(before), Some(message)) = (&self.before, message) {
            before(message, &route).await;
        }
        let held = message.map_or("", |message| message.message_id.0.as_str());
        match delivery.settle(&route).await {
            Ok(()) if delivery.parked() => self.counters.count_held(),
            Ok(()) => {
                self.counters.count(&route, duplicate);
                self.held.forget(held);
            }
            Err(error) if matches!(route, Route::Ack) => {
                // The effect is committed: the redelivery the broker makes is a duplicate.
                self.counters.count(&route, duplicate);
                tracing::warn!(error = %ErrorChain(&error), "could not acknowledge a delivery; the broker delivers it again");
            }
            Err(error) => {
                let after = self.held.next(held);
                tracing::warn!(
                    error = %ErrorChain(&error),
                    ?after,
                    "could not publish a delivery's retry or dead letter; handed back to the broker after a back-off"
                );
                self.counters.count_released();
                if !D::RELEASE_DELAYS {
                    // Held here for the back-off, so that the broker does not hand it straight back.
                    tokio::select! {
                        () = tokio::time::sleep(after) => {}
                        () = self.shutdown.cancelled() => {}
                    }
                }
                delivery.release(after).await;
            }
        }
    }
}

/// The back-off of each message whose retry or dead letter the broker did not take: 1 s, doubling
/// up to a minute, forgotten once its message is settled. At most [`ReleaseBackoff::MOST`] messages are
/// remembered (beyond that, the oldest memory is dropped and such a message starts again at 1 s).
#[derive(Debug, Default)]
struct ReleaseBackoff {
    failures: std::sync::Mutex<std::collections::HashMap<String, Backoff>>,
}

impl ReleaseBackoff {
    const MOST: usize = 10_000;
    const FIRST: Duration = Duration::from_secs(1);
    const LONGEST: Duration = Duration::from_secs(60);

    fn next(&self, message_id: &str) -> Duration {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        if failures.len() >= Self::MOST && !failures.contains_key(message_id) {
            failures.clear();
        }
        failures
            .entry(message_id.to_owned())
            .or_insert_with(|| Backoff::new(Self::FIRST, Self::LONGEST))
            .next()
    }

    fn forget(&self, message_id: &str) {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        if !failures.is_empty() {
            failures.remove(message_id);
        }
    }
}
