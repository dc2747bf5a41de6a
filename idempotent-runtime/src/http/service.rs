//! The tower service a layer wraps a route in: it hands each request to `flow::handle`.

use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum_core::extract::Request;
use axum_core::response::{IntoResponse, Response};

use super::config::LayerState;
use super::flow;
use crate::store::try_claim::HttpBackend;

/// The service [`IdempotencyLayer`](super::IdempotencyLayer) wraps a route in.
pub struct Idempotent<S, DB: HttpBackend> {
    inner: S,
    shared: Arc<LayerState<DB>>,
}

impl<S, DB: HttpBackend> Idempotent<S, DB> {
    /// Returns the service that runs `inner` behind the layer whose state is `shared`.
    pub(crate) fn new(inner: S, shared: Arc<LayerState<DB>>) -> Self {
        Self { inner, shared }
    }
}

impl<S: Clone, DB: HttpBackend> Clone for Idempotent<S, DB> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, DB: HttpBackend> fmt::Debug for Idempotent<S, DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotent")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, DB> tower::Service<Request> for Idempotent<S, DB>
where
    S: tower::Service<Request, Error = Infallible> + Clone + Send + 'static,
    S::Response: IntoResponse,
    S::Future: Send + 'static,
    DB: HttpBackend,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // The service that was polled ready handles this request; a clone waits for the next.
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        Box::pin(flow::handle(self.shared.clone(), inner, request))
    }
}
