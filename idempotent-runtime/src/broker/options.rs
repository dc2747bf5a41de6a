//! What every runner is configured with, whatever its broker, and the workers it makes.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::batch::{BatchBody, BatchWorker, Batches, in_batches};
use super::delivery::Delivery;
use super::drive::{DeliveriesAtOnce, WorkerFuture};
use super::message::Message;
use super::one_at_a_time::one_at_a_time;
use super::retry::RetryPolicy;
use super::settle::{BeforeSettle, Settler};
use super::stats::{Counters, RunnerStats};
use crate::error::Error;
use crate::inbox::Handled;
use tokio_util::sync::CancellationToken as Shutdown;

/// What every runner is configured with, whatever its broker.
pub(crate) struct RunnerOptions {
    pub(crate) workers: usize,
    pub(crate) retry: RetryPolicy,
    pub(crate) shutdown: Shutdown,
    pub(crate) counters: Arc<Counters>,
    pub(crate) before_settle: Option<BeforeSettle>,
    pub(crate) publish_timeout: Duration,
}

/// How long a runner waits, by default, for the broker to confirm a retry or a dead letter it
/// published.
pub const DEFAULT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(10);

impl Default for RunnerOptions {
    fn default() -> Self {
        Self {
            workers: 1,
            retry: RetryPolicy::default(),
            shutdown: Shutdown::new(),
            counters: Arc::default(),
            before_settle: None,
            publish_timeout: DEFAULT_PUBLISH_TIMEOUT,
        }
    }
}

impl RunnerOptions {
    /// What the runner counted so far.
    pub(crate) fn stats(&self) -> impl Fn() -> RunnerStats + Send + Sync + 'static {
        let counters = self.counters.clone();
        move || counters.snapshot()
    }

    fn settler(&self) -> Arc<Settler> {
        Arc::new(Settler::new(
            self.retry,
            self.counters.clone(),
            self.before_settle.clone(),
            self.shutdown.clone(),
        ))
    }

    /// A handler from `new_worker` per worker, one delivery at a time: what [`drive`](super::drive::drive) takes.
    #[allow(clippy::type_complexity)]
    pub(crate) fn one_at_a_time<D, F, W, Fut, T, E>(
        &self,
        mut new_worker: F,
    ) -> (
        Vec<W>,
        DeliveriesAtOnce,
        impl FnMut(W, Vec<D>) -> WorkerFuture<W> + use<D, F, W, Fut, T, E>,
    )
    where
        D: Delivery,
        F: FnMut() -> W,
        W: FnMut(Message) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Handled<T>, Error<E>>> + Send,
        T: Send + 'static,
        E: fmt::Display + Send + 'static,
    {
        let workers = (0..self.workers).map(|_| new_worker()).collect();
        (
            workers,
            DeliveriesAtOnce::ONE,
            one_at_a_time(self.settler()),
        )
    }

    /// A worker's inbox and a body from `new_body` per worker, `batches` at a time: what
    /// [`drive`](super::drive::drive) takes.
    #[allow(clippy::type_complexity)]
    pub(crate) fn in_batches<D, DB, F, B, T, E>(
        &self,
        inbox: &crate::inbox::Inbox<DB>,
        consumer: String,
        batches: Batches,
        mut new_body: F,
    ) -> (
        Vec<BatchWorker<DB, B>>,
        DeliveriesAtOnce,
        impl FnMut(BatchWorker<DB, B>, Vec<D>) -> WorkerFuture<BatchWorker<DB, B>>
        + use<D, DB, F, B, T, E>,
    )
    where
        D: Delivery,
        DB: crate::store::Backend,
        F: FnMut() -> B,
        B: BatchBody<DB, T, E>,
        T: Send + 'static,
        E: std::error::Error + Send + 'static,
    {
        let workers = (0..self.workers)
            .map(|_| BatchWorker {
                inbox: inbox.for_worker(),
                body: new_body(),
            })
            .collect();
        (
            workers,
            batches.take(),
            in_batches(consumer.into(), self.settler()),
        )
    }
}
