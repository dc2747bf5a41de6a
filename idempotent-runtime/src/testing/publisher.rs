//! A publisher for unit tests: it keeps what a relay hands it, and fails when told to.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::outbox::{Publication, PublishError, Publisher};

/// A [`Publisher`] that keeps every publication it is given, in order, and answers the next ones
/// with the errors you queue ([`RecordingPublisher::fail_next`]): a relay's behaviour under a
/// broker's refusals and outages, in a unit test without a broker. Clones share what they keep.
///
/// ```
/// # use idempotent_runtime as idempotent;
/// use idempotent::outbox::{Destination, OutgoingMessage, PublishError, Publication, Publisher};
/// use idempotent::testing::RecordingPublisher;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let publisher = RecordingPublisher::new();
/// publisher.fail_next(PublishError::Rejected { reason: "no route".into() });
/// let message = OutgoingMessage::new(Destination::queue("receipts"), b"{}".to_vec());
/// let publication = Publication::new("m-1", &message);
/// assert!(publisher.publish(&publication).await.is_err());
/// publisher.publish(&publication).await.unwrap();
/// assert_eq!(publisher.published(), [publication]);
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct RecordingPublisher {
    kept: Arc<Mutex<Kept>>,
}

#[derive(Debug, Default)]
struct Kept {
    published: Vec<Publication>,
    failures: VecDeque<PublishError>,
}

impl RecordingPublisher {
    /// Creates a publisher that has kept nothing and fails nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Returns the publications it took, in the order it took them.
    pub fn published(&self) -> Vec<Publication> {
        self.kept().published.clone()
    }

    /// Answers the next publication with `error` instead of taking it; queued errors are used
    /// one per publication, in order.
    pub fn fail_next(&self, error: PublishError) {
        self.kept().failures.push_back(error);
    }

    fn kept(&self) -> MutexGuard<'_, Kept> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Publisher for RecordingPublisher {
    async fn publish(&self, publication: &Publication) -> Result<(), PublishError> {
        let mut kept = self.kept();
        if let Some(error) = kept.failures.pop_front() {
            return Err(error);
        }
        kept.published.push(publication.clone());
        Ok(())
    }
}
