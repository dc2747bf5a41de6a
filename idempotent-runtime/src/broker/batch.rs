//! A runner in batch mode: deliveries collected into batches, one transaction each, and each
//! delivery settled by its own outcome.

use std::sync::Arc;
use std::time::Duration;

use super::delivery::Delivery;
use super::drive::{DeliveriesAtOnce, WorkerFuture};
use super::message::Message;
use super::panicked::caught;
use super::route::{Route, inbox_failure_reason};
use super::settle::Settler;
use crate::error::Error;
use crate::inbox::Handled;

/// How a runner collects deliveries into batches: at most `size` messages in one transaction,
/// waiting at most `linger` for more once it has one. See the runners' `run_batches`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Batches {
    /// The most messages in one transaction (default 50; on PostgreSQL keep it under 64, see
    /// [`Inbox::handle_batch_each`](crate::Inbox::handle_batch_each)).
    pub size: usize,
    /// How long a worker waits for more once it has one (default 5 ms).
    pub linger: Duration,
}

impl Default for Batches {
    fn default() -> Self {
        Self {
            size: 50,
            linger: Duration::from_millis(5),
        }
    }
}

impl Batches {
    /// Batches of at most `size` messages, waiting at most `linger` for more.
    pub fn new(size: usize, linger: Duration) -> Self {
        Self {
            size: size.max(1),
            linger,
        }
    }

    pub(crate) fn take(self) -> DeliveriesAtOnce {
        DeliveriesAtOnce {
            most: self.size,
            linger: self.linger,
        }
    }
}

/// The body of a message in a batch: runs on the batch transaction's connection (in a savepoint of
/// its own) and returns its value or its error.
pub trait BatchBody<DB: crate::store::Backend, T, E>: Send + 'static {
    /// Runs the body for `message`.
    fn run<'a>(
        &'a mut self,
        conn: &'a mut DB::Connection,
        message: &'a Message,
    ) -> futures_util::future::BoxFuture<'a, Result<T, E>>;
}

impl<DB, T, E, F> BatchBody<DB, T, E> for F
where
    DB: crate::store::Backend,
    F: for<'a> FnMut(
            &'a mut DB::Connection,
            &'a Message,
        ) -> futures_util::future::BoxFuture<'a, Result<T, E>>
        + Send
        + 'static,
{
    fn run<'a>(
        &'a mut self,
        conn: &'a mut DB::Connection,
        message: &'a Message,
    ) -> futures_util::future::BoxFuture<'a, Result<T, E>> {
        self(conn, message)
    }
}

/// A worker of a runner in batch mode: its inbox, and its body.
pub(crate) struct BatchWorker<DB: crate::store::Backend, B> {
    pub(crate) inbox: crate::inbox::Inbox<DB>,
    pub(crate) body: B,
}

/// The `process` of [`drive`](super::drive::drive) for batches: one transaction per batch
/// ([`Inbox::handle_batch_each`](crate::Inbox::handle_batch_each)), then each delivery settled by
/// its own outcome.
pub(crate) fn in_batches<D, DB, B, T, E>(
    consumer: Arc<str>,
    settler: Arc<Settler>,
) -> impl FnMut(BatchWorker<DB, B>, Vec<D>) -> WorkerFuture<BatchWorker<DB, B>>
where
    D: Delivery,
    DB: crate::store::Backend,
    B: BatchBody<DB, T, E>,
    T: Send + 'static,
    E: std::error::Error + Send + 'static,
{
    move |mut worker: BatchWorker<DB, B>, unit: Vec<D>| {
        let (consumer, settler) = (consumer.clone(), settler.clone());
        Box::pin(async move {
            let mut taken = Vec::with_capacity(unit.len());
            let mut keyless = Vec::new();
            for delivery in unit {
                match delivery.message() {
                    Ok(message) => taken.push((delivery, message)),
                    Err(reason) => keyless.push((delivery, reason)),
                }
            }
            let (deliveries, messages): (Vec<D>, Vec<Message>) = taken.into_iter().unzip();
            let span = tracing::info_span!("batch", size = messages.len());
            for message in &messages {
                crate::trace_context::link_from(&span, |name| message.header(name));
            }
            let outcomes = {
                let batch = caught(|| {
                    tracing::Instrument::instrument(
                        run_batch(&mut worker, &consumer, &messages),
                        span,
                    )
                });
                tokio::pin!(batch);
                // Each delivery kept alive while the batch runs (JetStream's in-progress acks,
                // SQS's visibility), as a message alone is.
                let alive = futures_util::future::join_all(deliveries.iter().map(D::keep_alive));
                tokio::select! {
                    outcomes = &mut batch => outcomes,
                    _ = alive => batch.await,
                }
            };
            let policy = &settler.policy;
            let routes: Vec<(Route, bool)> = match &outcomes {
                Err(panicked) => {
                    // The batch's transaction went with the panic: every message tries again.
                    tracing::warn!(reason = %panicked, "a body of the batch panicked");
                    messages
                        .iter()
                        .map(|message| {
                            (
                                Route::failure(true, panicked, message.attempt, policy),
                                false,
                            )
                        })
                        .collect()
                }
                Ok(Ok(outcomes)) => outcomes
                    .iter()
                    .zip(&messages)
                    .map(|(outcome, message)| {
                        let duplicate = matches!(outcome, Ok(Handled::Duplicate { .. }));
                        (Route::of(outcome, message.attempt, policy), duplicate)
                    })
                    .collect(),
                Ok(Err(error)) => {
                    // Every message shares the batch's fate.
                    let reason = inbox_failure_reason(error);
                    tracing::warn!(%reason, "the batch failed as a whole");
                    messages
                        .iter()
                        .map(|message| {
                            let route = Route::failure(
                                error.is_retryable(),
                                &reason,
                                message.attempt,
                                policy,
                            );
                            (route, false)
                        })
                        .collect()
                }
            };
            let settler = &settler;
            let mut settled = Vec::new();
            for (delivery, reason) in keyless {
                let route = Route::DeadLetter {
                    reason,
                    attempts: 1,
                };
                settled.push(Box::pin(settler.settle(delivery, None, route, false))
                    as futures_util::future::BoxFuture<'_, ()>);
            }
            for ((delivery, message), (route, duplicate)) in
                deliveries.into_iter().zip(&messages).zip(routes)
            {
                settled.push(Box::pin(settler.settle(
                    delivery,
                    Some(message),
                    route,
                    duplicate,
                )));
            }
            futures_util::future::join_all(settled).await;
            worker
        })
    }
}

/// Handles `messages` in one transaction with an outcome each, as
/// [`Inbox::handle_batch_each`](crate::Inbox::handle_batch_each) does, with the body a worker of a
/// runner has (whose futures are `Send`, so that batches run on worker tasks).
async fn run_batch<DB, B, T, E>(
    worker: &mut BatchWorker<DB, B>,
    consumer: &str,
    messages: &[Message],
) -> Result<Vec<Result<Handled<T>, Error<E>>>, crate::error::InboxError>
where
    DB: crate::store::Backend,
    B: BatchBody<DB, T, E>,
    E: std::error::Error + 'static,
{
    let keys = messages
        .iter()
        .map(|message| crate::key::message_key(&message.message_id))
        .collect::<Result<Vec<_>, _>>()?;
    let inbox = &worker.inbox;
    let mut batch = inbox.claim_batch(consumer, &keys).await?;
    let mut outcomes = Vec::with_capacity(messages.len());
    for (index, (message, key)) in messages.iter().zip(keys).enumerate() {
        if !batch.is_new(index) {
            outcomes.push(Ok(Handled::Duplicate {
                consumer: consumer.to_owned(),
                key,
                response: None,
            }));
            continue;
        }
        batch.mark(index).await?;
        match worker.body.run(batch.connection(), message).await {
            Ok(value) => outcomes.push(Ok(Handled::Processed(value))),
            Err(error) => {
                batch
                    .undo(index, &inbox.config.statements, consumer, &key)
                    .await?;
                outcomes.push(Err(Error::of_body(error, |e| crate::store::fault_of(e))));
            }
        }
    }
    batch.commit().await?;
    Ok(outcomes)
}
