//! The drive loop every runner shares: deliveries taken while a worker is free, run on it, and
//! settled before the runner returns.

use std::future::Future;
use std::time::Duration;

use tokio::task::JoinSet;

use super::delivery::Delivery;
use super::error::BrokerError;
use tokio_util::sync::CancellationToken as Shutdown;

/// How many deliveries a worker takes at once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeliveriesAtOnce {
    /// At most this many.
    pub(crate) most: usize,
    /// Waiting at most this long for more, once it has one.
    pub(crate) linger: Duration,
}

impl DeliveriesAtOnce {
    /// One delivery at a time.
    pub(crate) const ONE: DeliveriesAtOnce = DeliveriesAtOnce {
        most: 1,
        linger: Duration::ZERO,
    };
}

/// Takes deliveries while a worker is free and the runner is not shut down, `take` at a time,
/// and runs them on the free worker with `process`, which hands the worker back when it is done;
/// returns when `deliveries` ends or fails (the broker's errors the runner cannot recover from) or
/// `shutdown` is cancelled, once every delivery in flight is settled.
pub(crate) async fn drive<D, S, W, P, PF>(
    deliveries: S,
    shutdown: Shutdown,
    workers: Vec<W>,
    take: DeliveriesAtOnce,
    mut process: P,
) -> Result<(), BrokerError>
where
    D: Delivery,
    S: futures_util::Stream<Item = Result<D, BrokerError>>,
    W: Send + 'static,
    P: FnMut(W, Vec<D>) -> PF,
    PF: Future<Output = W> + Send + 'static,
{
    use futures_util::StreamExt;
    let mut deliveries = std::pin::pin!(deliveries);
    let (idle_tx, mut idle) = tokio::sync::mpsc::channel(workers.len().max(1));
    for worker in workers {
        idle_tx.send(worker).await.expect("the receiver is here");
    }
    let mut running = JoinSet::new();
    let mut failure = None;
    'run: loop {
        // A free worker first, so that no delivery waits in the runner for one.
        let worker = tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            Some(finished) = running.join_next(), if !running.is_empty() => {
                finished.expect("a worker task panicked");
                continue;
            }
            worker = idle.recv() => worker.expect("the sender is here"),
        };
        let mut unit = Vec::with_capacity(take.most);
        let deadline = tokio::time::Instant::now() + take.linger;
        while unit.len() < take.most {
            let more = async {
                if unit.is_empty() {
                    deliveries.next().await
                } else {
                    // Once it has one, a worker waits for more until the deadline only.
                    tokio::time::timeout_at(deadline, deliveries.next())
                        .await
                        .unwrap_or(None)
                }
            };
            let next = tokio::select! {
                biased;
                () = shutdown.cancelled(), if unit.is_empty() => break 'run,
                next = more => next,
            };
            match next {
                Some(Ok(delivery)) => unit.push(delivery),
                Some(Err(error)) => {
                    failure = Some(error);
                    break;
                }
                None => break,
            }
        }
        if unit.is_empty() {
            break;
        }
        let idle_tx = idle_tx.clone();
        let processed = process(worker, unit);
        running.spawn(async move {
            let worker = processed.await;
            let _ = idle_tx.send(worker).await;
        });
        if failure.is_some() {
            break;
        }
    }
    // Whatever stopped the runner, the deliveries in flight finish and are settled.
    while let Some(finished) = running.join_next().await {
        finished.expect("a worker task panicked");
    }
    failure.map_or(Ok(()), Err)
}

/// What processing a unit of deliveries on a worker comes to: the worker back, once its
/// deliveries are settled (or handed back to the broker).
pub(crate) type WorkerFuture<W> = futures_util::future::BoxFuture<'static, W>;
