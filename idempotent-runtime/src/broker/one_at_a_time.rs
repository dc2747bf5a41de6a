//! A runner's handlers of one message at a time: each delivery run through its worker's handler
//! and settled by the outcome.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use super::delivery::Delivery;
use super::drive::WorkerFuture;
use super::message::Message;
use super::panicked::caught;
use super::route::Route;
use super::settle::Settler;
use crate::error::Error;
use crate::inbox::Handled;

/// The `process` of [`drive`](super::drive::drive) for handlers of one message at a time.
pub(crate) fn one_at_a_time<D, W, Fut, T, E>(
    settler: Arc<Settler>,
) -> impl FnMut(W, Vec<D>) -> WorkerFuture<W>
where
    D: Delivery,
    W: FnMut(Message) -> Fut + Send + 'static,
    Fut: Future<Output = Result<Handled<T>, Error<E>>> + Send,
    T: Send + 'static,
    E: fmt::Display + Send + 'static,
{
    move |mut worker: W, mut unit: Vec<D>| {
        let settler = settler.clone();
        Box::pin(async move {
            let delivery = unit.pop().expect("a unit of one");
            handle(&mut worker, delivery, &settler).await;
            worker
        })
    }
}

/// Runs one delivery through a worker's handler and settles it by the outcome.
async fn handle<D, W, Fut, T, E>(worker: &mut W, delivery: D, settler: &Settler)
where
    D: Delivery,
    W: FnMut(Message) -> Fut,
    Fut: Future<Output = Result<Handled<T>, Error<E>>>,
    E: fmt::Display,
{
    let message = match delivery.message() {
        Ok(message) => message,
        Err(reason) => {
            tracing::warn!(%reason, "dead-lettering a delivery the handler cannot take");
            let route = Route::DeadLetter {
                reason,
                attempts: 1,
            };
            return settler.settle(delivery, None, route, false).await;
        }
    };
    let attempt = message.attempt;
    let kept = settler.before.is_some().then(|| message.clone());
    let span = tracing::info_span!(
        "delivery",
        message_id = %message.message_id,
        attempt,
        route = tracing::field::Empty,
    );
    // A child of the span that sent it, if its headers carry one's trace context.
    crate::trace_context::continue_from(&span, |name| message.header(name));
    let outcome = {
        let call = caught(|| tracing::Instrument::instrument(worker(message), span.clone()));
        tokio::pin!(call);
        let alive = delivery.keep_alive();
        tokio::pin!(alive);
        tokio::select! {
            outcome = &mut call => outcome,
            () = &mut alive => call.await,
        }
    };
    let (route, duplicate) = match &outcome {
        Ok(outcome) => (
            Route::of(outcome, attempt, &settler.policy),
            matches!(outcome, Ok(Handled::Duplicate { .. })),
        ),
        Err(panicked) => {
            let route = Route::failure(true, panicked, attempt, &settler.policy);
            (route, false)
        }
    };
    span.record("route", tracing::field::debug(&route));
    match &route {
        Route::Ack => {}
        Route::Retry { attempt, after } => {
            tracing::info!(parent: &span, next_attempt = attempt, ?after, "retrying later")
        }
        Route::DeadLetter { reason, attempts } => {
            tracing::warn!(parent: &span, %reason, attempts, "dead-lettering")
        }
    }
    settler
        .settle(delivery, kept.as_ref(), route, duplicate)
        .await
}
