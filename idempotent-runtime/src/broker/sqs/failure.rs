//! What an SQS request's error means for the runner and the publisher: the queue is gone, SQS
//! refused the request for good, or SQS (or the way to it) is away for now.

use std::fmt;

use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};

/// An SQS request's error, sorted by what the caller does about it.
#[derive(Debug)]
pub(crate) enum Failure {
    /// The queue does not exist (deleted, or never made).
    NoQueue(String),
    /// SQS answered with an error of the request's own (too large, invalid contents, too many
    /// attributes, a receipt handle that expired): trying the same again gives the same answer.
    Refused(String),
    /// SQS did not answer, throttled the request, or failed on its side: worth trying again.
    Unavailable(String),
}

/// The error codes SQS answers when a queue does not exist (the JSON protocol's and the query
/// protocol's spelling).
const NO_QUEUE: [&str; 2] = [
    "QueueDoesNotExist",
    "AWS.SimpleQueueService.NonExistentQueue",
];

/// The error codes that mean "later": throttling, and SQS's own trouble.
const LATER: [&str; 6] = [
    "RequestThrottled",
    "ThrottlingException",
    "KmsThrottled",
    "ServiceUnavailable",
    "InternalError",
    "InternalFailure",
];

impl Failure {
    /// Sorts `error`, the answer to a request about `queue`.
    pub(crate) fn of<E, R>(error: &SdkError<E, R>, queue: &str) -> Self
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
        R: fmt::Debug + 'static,
    {
        let text = || super::super::error::ErrorChain(error).to_string();
        let Some(service) = error.as_service_error() else {
            // Not an answer of SQS: the connection failed, timed out, or the answer was garbled.
            return Failure::Unavailable(text());
        };
        let code = service.code().unwrap_or("");
        let said = match service.message() {
            Some(message) => format!("{code}: {message}"),
            None if code.is_empty() => text(),
            None => code.to_owned(),
        };
        if NO_QUEUE.contains(&code) {
            Failure::NoQueue(format!("the queue {queue} does not exist ({said})"))
        } else if LATER.contains(&code) || code.is_empty() {
            Failure::Unavailable(said)
        } else {
            Failure::Refused(said)
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::NoQueue(text) | Failure::Refused(text) | Failure::Unavailable(text) => {
                f.write_str(text)
            }
        }
    }
}

impl std::error::Error for Failure {}
