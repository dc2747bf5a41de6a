//! One delivery from a broker, as the shared driver handles it: the trait each broker implements.

use std::future::Future;
use std::time::Duration;

use super::error::BrokerError;
use super::message::Message;
use super::route::Route;

/// One delivery from a broker, as the shared driver handles it.
pub(crate) trait Delivery: Send + 'static {
    /// The message for the handler, or the reason to dead-letter it without one.
    fn message(&self) -> Result<Message, String>;

    /// Whether [`release`](Self::release) itself makes the broker wait (JetStream's delayed
    /// `nak`); otherwise the runner holds the delivery for the back-off before it releases it.
    const RELEASE_DELAYS: bool;

    /// Settles the delivery by `route`: acknowledges it, or publishes its retry or dead letter and
    /// then acknowledges it. An error leaves the delivery unsettled.
    fn settle(&self, route: &Route) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// Whether [`settle`](Self::settle) parked the delivery for an operator rather than settle it
    /// by its route (the Kafka runner's [`hold_partition_on_failure`](super::kafka::Runner::hold_partition_on_failure)).
    fn parked(&self) -> bool {
        false
    }

    /// Hands the delivery back to the broker, to be delivered again (after `after`, where the
    /// broker can wait).
    fn release(self, after: Duration) -> impl Future<Output = ()> + Send;

    /// Keeps the delivery alive while its handler runs (JetStream's in-progress acks); never
    /// returns while it works.
    fn keep_alive(&self) -> impl Future<Output = ()> + Send + '_ {
        std::future::pending()
    }
}
