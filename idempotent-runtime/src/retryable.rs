//! A handler's own transient failure, marked as one.

use std::fmt;

/// Marks an error of a handler's body as transient, so that a redelivery may succeed: a downstream
/// service's 503, a timeout calling it, a rate limit. The inbox finds it among the sources of the
/// body's error, as it finds a database failure there: the outcome is [`Error::Transient`](crate::Error::Transient), which
/// [is retryable](crate::Error::is_retryable), in `#[idempotent]` handlers, in
/// [`Inbox::handle_batch_each`](crate::Inbox::handle_batch_each) and in the broker runners'
/// one-message and batch modes alike. Without it, a body's own error is
/// [`Error::Handler`](crate::Error::Handler), which the runners dead-letter at once.
///
/// Hold it in your error type as a source (`#[from]` or `#[source]` with `thiserror`), and make it
/// with [`Retryable::new`]; `?` then converts it:
///
/// ```
/// # use idempotent_runtime as idempotent;
/// use idempotent::Retryable;
///
/// #[derive(Debug, thiserror::Error)]
/// enum ShopError {
///     #[error("the payment service is unavailable")]
///     PaymentsUnavailable(#[from] Retryable),
///     #[error("no such order")]
///     NoSuchOrder,
/// }
///
/// fn charge(status: u16) -> Result<(), ShopError> {
///     if status == 503 {
///         Err(Retryable::new(format!("the payment service answered {status}")))?;
///     }
///     Ok(())
/// }
/// # assert!(matches!(charge(503), Err(ShopError::PaymentsUnavailable(_))));
/// ```
///
/// Not behind `#[error(transparent)]`: a transparent variant hands out the sources *of* what it
/// wraps, so the mark would not be among them. `Retryable` itself is transparent: it displays as
/// the error it wraps, and gives that error's sources as its own.
pub struct Retryable(Box<dyn std::error::Error + Send + Sync + 'static>);

impl Retryable {
    /// Marks `error` (an error, or a message) as transient.
    pub fn new(error: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>) -> Self {
        Self(error.into())
    }

    /// Returns the error it marks.
    pub fn get_ref(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self.0.as_ref()
    }

    /// Returns the error it marks.
    pub fn into_inner(self) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self.0
    }
}

impl fmt::Debug for Retryable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Retryable").field(&self.0).finish()
    }
}

impl fmt::Display for Retryable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for Retryable {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}
