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

/// The builder methods every runner has, and its `run` and `run_batches`, written once: a runner
/// is a struct with `options: RunnerOptions` and an `async fn consume(self, workers, take,
/// process)`. Each runner gives the docs of `workers`, `publish_timeout` and `run`, which say what
/// its broker does.
macro_rules! runner_builder {
    (
        $(#[$workers:meta])* workers;
        $(#[$publish_timeout:meta])* publish_timeout;
        $(#[$run:meta])* run;
    ) => {
        $(#[$workers])*
        pub fn workers(mut self, workers: usize) -> Self {
            self.options.workers = workers.max(1);
            self
        }

        /// Retries retryable failures by `policy`.
        pub fn retry(mut self, policy: $crate::broker::RetryPolicy) -> Self {
            self.options.retry = policy;
            self
        }

        $(#[$publish_timeout])*
        pub fn publish_timeout(mut self, timeout: ::std::time::Duration) -> Self {
            self.options.publish_timeout = timeout;
            self
        }

        /// Stops gracefully when `shutdown` is cancelled.
        pub fn shutdown_on(mut self, shutdown: $crate::broker::Shutdown) -> Self {
            self.options.shutdown = shutdown;
            self
        }

        /// Calls `hook` with each delivery's message and route once its outcome is known, before
        /// the runner settles it (for logging, auditing or tests); the delivery is settled when the
        /// hook's future completes. Deliveries dead-lettered for lack of a message id are not
        /// shown to it.
        pub fn before_settle(mut self, hook: $crate::broker::BeforeSettle) -> Self {
            self.options.before_settle = Some(hook);
            self
        }

        /// Returns what the runner counted so far; the same counters [`run`](Self::run) returns at
        /// the end.
        pub fn stats(
            &self,
        ) -> impl Fn() -> $crate::broker::RunnerStats + Send + Sync + 'static {
            self.options.stats()
        }

        $(#[$run])*
        pub async fn run<F, W, Fut, T, E>(
            self,
            new_worker: F,
        ) -> Result<$crate::broker::RunnerStats, $crate::broker::BrokerError>
        where
            F: FnMut() -> W,
            W: FnMut($crate::broker::Message) -> Fut + Send + 'static,
            Fut: ::std::future::Future<
                    Output = Result<$crate::Handled<T>, $crate::error::Error<E>>,
                > + Send,
            T: Send + 'static,
            E: ::std::fmt::Display + Send + 'static,
        {
            let (workers, take, process) = self.options.one_at_a_time(new_worker);
            self.consume(workers, take, process).await
        }

        /// Consumes as [`run`](Self::run) does, handling the deliveries in batches: a worker takes
        /// up to `batches.size` deliveries, runs `body` for each new message in one transaction on
        /// its worker's inbox (each in a savepoint, as
        /// [`Inbox::handle_batch_each`](crate::Inbox::handle_batch_each) does), commits once, then
        /// settles each delivery by its own outcome: the good ones and the duplicates are
        /// acknowledged, a failing one retried or dead-lettered alone.
        pub async fn run_batches<DB, F, B, T, E>(
            self,
            inbox: $crate::Inbox<DB>,
            consumer: impl Into<String>,
            batches: $crate::broker::Batches,
            new_body: F,
        ) -> Result<$crate::broker::RunnerStats, $crate::broker::BrokerError>
        where
            DB: $crate::store::Backend,
            F: FnMut() -> B,
            B: $crate::broker::BatchBody<DB, T, E>,
            T: Send + 'static,
            E: ::std::error::Error + Send + 'static,
        {
            let (workers, take, process) =
                self.options
                    .in_batches(&inbox, consumer.into(), batches, new_body);
            self.consume(workers, take, process).await
        }
    };
}
pub(crate) use runner_builder;
