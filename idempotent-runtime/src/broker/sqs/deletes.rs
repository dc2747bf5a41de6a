//! Acknowledgements in batches: the runner's deletes go out as `DeleteMessageBatch` requests of up
//! to ten, each delivery told its own entry's answer.

use std::sync::Arc;
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::DeleteMessageBatchRequestEntry;
use tokio::sync::{Semaphore, mpsc, oneshot};

use super::delivery::within;
use super::failure::Failure;

/// The most entries SQS takes in one batch request.
pub(super) const MOST_PER_BATCH: usize = 10;

/// How many batch requests are under way at once; deletes asked for meanwhile wait and go out
/// together in the next one.
const AT_ONCE: usize = 4;

/// One delete asked for: the receipt handle, and where its answer goes.
type Asked = (String, oneshot::Sender<Result<(), Failure>>);

/// The handle through which deliveries ask for their deletes.
#[derive(Debug, Clone)]
pub(super) struct Deletes {
    asks: mpsc::UnboundedSender<Asked>,
}

impl Deletes {
    /// Starts the task that sends the deletes of the queue at `url`, each request waiting at most
    /// `timeout` for SQS; it ends once every handle is dropped and the deletes asked for are
    /// answered.
    pub(super) fn start(client: Client, url: String, timeout: Duration) -> Self {
        let (asks, received) = mpsc::unbounded_channel();
        tokio::spawn(send_batches(client, url, timeout, received));
        Self { asks }
    }

    /// Deletes the message received with `receipt_handle`, in a batch with the other deletes
    /// asked for at the same time; returns once SQS answered for it.
    pub(super) async fn delete(&self, receipt_handle: &str) -> Result<(), Failure> {
        let (answer, answered) = oneshot::channel();
        self.asks
            .send((receipt_handle.to_owned(), answer))
            .map_err(|_| Failure::Unavailable("the runner's deletes have stopped".into()))?;
        answered
            .await
            .unwrap_or_else(|_| Err(Failure::Unavailable("the delete was not answered".into())))
    }
}

/// Takes the deletes asked for, up to ten at a time, and sends each group as one batch request
/// once one of the [`AT_ONCE`] places is free.
async fn send_batches(
    client: Client,
    url: String,
    timeout: Duration,
    mut received: mpsc::UnboundedReceiver<Asked>,
) {
    let places = Arc::new(Semaphore::new(AT_ONCE));
    let url: Arc<str> = url.into();
    loop {
        let place = places.clone().acquire_owned().await.expect("never closed");
        let Some(first) = received.recv().await else {
            break;
        };
        let mut batch = vec![first];
        while batch.len() < MOST_PER_BATCH {
            match received.try_recv() {
                Ok(asked) => batch.push(asked),
                Err(_) => break,
            }
        }
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move {
            send_batch(&client, &url, timeout, batch).await;
            drop(place);
        });
    }
    // What is under way still answers: wait for every place to come back.
    let _ = places.acquire_many(AT_ONCE as u32).await;
}

/// Sends one batch request and tells each delete its entry's answer.
async fn send_batch(client: &Client, url: &str, timeout: Duration, batch: Vec<Asked>) {
    let entries = batch
        .iter()
        .enumerate()
        .map(|(n, (handle, _))| {
            DeleteMessageBatchRequestEntry::builder()
                .id(n.to_string())
                .receipt_handle(handle)
                .build()
                .expect("id and receipt handle are set")
        })
        .collect::<Vec<_>>();
    let sent = within(timeout, async {
        client
            .delete_message_batch()
            .queue_url(url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|error| Failure::of(&error, url))
    })
    .await;
    match sent {
        Ok(answer) => {
            let mut answers: Vec<Option<Result<(), Failure>>> =
                batch.iter().map(|_| None).collect();
            for done in answer.successful() {
                if let Some(slot) = done
                    .id()
                    .parse::<usize>()
                    .ok()
                    .and_then(|n| answers.get_mut(n))
                {
                    *slot = Some(Ok(()));
                }
            }
            for failed in answer.failed() {
                let said = format!(
                    "{}: {}",
                    failed.code(),
                    failed.message().unwrap_or("no message")
                );
                let failure = if failed.sender_fault() {
                    Failure::Refused(said)
                } else {
                    Failure::Unavailable(said)
                };
                if let Some(slot) = failed
                    .id()
                    .parse::<usize>()
                    .ok()
                    .and_then(|n| answers.get_mut(n))
                {
                    *slot = Some(Err(failure));
                }
            }
            for ((_, answer), said) in batch.into_iter().zip(answers) {
                let said = said.unwrap_or_else(|| {
                    Err(Failure::Unavailable(
                        "SQS did not answer for this entry".into(),
                    ))
                });
                let _ = answer.send(said);
            }
        }
        Err(failure) => {
            let said = failure.to_string();
            for (_, answer) in batch {
                let _ = answer.send(Err(Failure::Unavailable(said.clone())));
            }
        }
    }
}
