//! What the runner learns of its queue at start: its visibility timeout, and the dead-letter queue
//! of its redrive policy.

use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::QueueAttributeName;

use super::failure::Failure;
use crate::broker::error::BrokerError;
use crate::broker::outage::Outage;
use tokio_util::sync::CancellationToken as Shutdown;

/// The runner's queue, as it found it at start.
#[derive(Debug)]
pub(super) struct Queue {
    /// How long a received message stays invisible to other consumers.
    pub(super) visibility_timeout: Duration,
    /// The URL of the queue its redrive policy moves messages to.
    pub(super) dead_letters: String,
}

impl Queue {
    /// Reads `url`'s attributes and finds its dead-letter queue, waiting for SQS while it does not
    /// answer; `None` when `shutdown` came first. The redrive policy's `maxReceiveCount` must not
    /// be below `max_attempts`: SQS would move a message to the dead-letter queue before its last
    /// attempt, without a reason.
    pub(super) async fn find(
        client: &Client,
        url: &str,
        max_attempts: u32,
        shutdown: &Shutdown,
    ) -> Result<Option<Queue>, BrokerError> {
        let mut outage = Outage::new("sqs", url.to_owned(), None);
        loop {
            let found = tokio::select! {
                found = Self::read(client, url, max_attempts) => found,
                () = shutdown.cancelled() => return Ok(None),
            };
            match found {
                Err(Failure::Unavailable(reason)) => {
                    let after = outage.failed(&std::io::Error::other(reason));
                    tokio::select! {
                        () = tokio::time::sleep(after) => {}
                        () = shutdown.cancelled() => return Ok(None),
                    }
                }
                Err(failure @ (Failure::NoQueue(_) | Failure::Refused(_))) => {
                    return Err(BrokerError::broker(failure));
                }
                Ok(queue) => return queue.map(Some),
            }
        }
    }

    /// One attempt at [`find`](Self::find): the outer error is SQS's, the inner the queue's setup.
    async fn read(
        client: &Client,
        url: &str,
        max_attempts: u32,
    ) -> Result<Result<Queue, BrokerError>, Failure> {
        let attributes = client
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::All)
            .send()
            .await
            .map_err(|error| Failure::of(&error, url))?;
        let attributes = attributes.attributes();
        let attribute = |name: QueueAttributeName| attributes.and_then(|all| all.get(&name));
        let visibility_timeout = attribute(QueueAttributeName::VisibilityTimeout)
            .and_then(|seconds| seconds.parse().ok())
            .map_or(Duration::from_secs(30), Duration::from_secs);
        let refuse = |reason: String| {
            Ok(Err(BrokerError::DeadLetterTarget {
                target: url.to_owned(),
                reason,
            }))
        };
        let Some(policy) = attribute(QueueAttributeName::RedrivePolicy) else {
            return refuse(
                "the queue has no redrive policy: give it one with a dead-letter queue \
                 (deadLetterTargetArn) and a maxReceiveCount"
                    .into(),
            );
        };
        let Some(redrive) = Redrive::parse(policy) else {
            return refuse(format!(
                "its redrive policy is not one SQS writes: {policy}"
            ));
        };
        if redrive.max_receive_count < u64::from(max_attempts) {
            return refuse(format!(
                "its redrive policy's maxReceiveCount is {}, below the retry policy's {max_attempts} \
                 attempts: SQS would move messages to the dead-letter queue before their last \
                 attempt, without a reason",
                redrive.max_receive_count
            ));
        }
        let Some((account, name)) = queue_of_arn(&redrive.target) else {
            return refuse(format!(
                "its dead-letter queue {} is not a queue's ARN",
                redrive.target
            ));
        };
        let dead_letters = match client
            .get_queue_url()
            .queue_name(name)
            .queue_owner_aws_account_id(account)
            .send()
            .await
        {
            Ok(found) => found.queue_url().unwrap_or_default().to_owned(),
            Err(error) => match Failure::of(&error, name) {
                Failure::Unavailable(reason) => return Err(Failure::Unavailable(reason)),
                failure => return refuse(failure.to_string()),
            },
        };
        Ok(Ok(Queue {
            visibility_timeout,
            dead_letters,
        }))
    }
}

/// A queue's redrive policy, as SQS keeps it (JSON, with the count as a number or a string).
#[derive(Debug, Clone, PartialEq)]
struct Redrive {
    target: String,
    max_receive_count: u64,
}

impl Redrive {
    fn parse(policy: &str) -> Option<Self> {
        let policy: serde_json::Value = serde_json::from_str(policy).ok()?;
        let target = policy.get("deadLetterTargetArn")?.as_str()?.to_owned();
        let count = policy.get("maxReceiveCount")?;
        let max_receive_count = count
            .as_u64()
            .or_else(|| count.as_str().and_then(|count| count.parse().ok()))?;
        Some(Redrive {
            target,
            max_receive_count,
        })
    }
}

/// The account and the name of the queue an SQS ARN names (`arn:aws:sqs:<region>:<account>:<name>`).
fn queue_of_arn(arn: &str) -> Option<(&str, &str)> {
    let mut parts = arn.splitn(6, ':');
    let (Some("arn"), Some(_), Some("sqs"), Some(_), Some(account), Some(name)) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return None;
    };
    (!name.is_empty()).then_some((account, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redrive_policies_parse_with_the_count_as_a_number_or_a_string() {
        let expected = Redrive {
            target: "arn:aws:sqs:us-east-1:123456789012:orders-dead".into(),
            max_receive_count: 5,
        };
        for count in ["5", "\"5\""] {
            let policy = format!(
                r#"{{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:123456789012:orders-dead","maxReceiveCount":{count}}}"#
            );
            assert_eq!(Redrive::parse(&policy), Some(expected.clone()));
        }
        assert_eq!(Redrive::parse("{}"), None);
        assert_eq!(Redrive::parse("not json"), None);
    }

    #[test]
    fn arns_name_their_account_and_queue() {
        assert_eq!(
            queue_of_arn("arn:aws:sqs:eu-west-1:123456789012:orders.fifo"),
            Some(("123456789012", "orders.fifo"))
        );
        assert_eq!(
            queue_of_arn("arn:aws:sns:eu-west-1:123456789012:orders"),
            None
        );
        assert_eq!(queue_of_arn("arn:aws:sqs:eu-west-1:123456789012:"), None);
        assert_eq!(queue_of_arn("orders"), None);
    }
}
