//! A handler that panics is one bad message, not a runner that ends: its panic is caught and the
//! message goes on as a retryable failure whose reason is the panic's message.

use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;

/// Runs `call` (which makes the handler's future) and its future; `Err` with the panic's message
/// when either panicked. The handler's transaction was dropped with its future, so nothing it
/// did is committed.
pub(crate) async fn caught<F, Fut>(call: F) -> Result<Fut::Output, String>
where
    F: FnOnce() -> Fut,
    Fut: Future,
{
    let future = std::panic::catch_unwind(AssertUnwindSafe(call)).map_err(message)?;
    AssertUnwindSafe(future)
        .catch_unwind()
        .await
        .map_err(message)
}

/// What a panic said, as a dead letter's reason reads it.
fn message(panic: Box<dyn std::any::Any + Send>) -> String {
    let said = panic
        .downcast_ref::<&str>()
        .map(|said| (*said).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned());
    super::route::truncate_for_header(format!("the handler panicked: {said}"))
}

#[cfg(test)]
mod tests {
    use super::caught;

    #[tokio::test]
    async fn a_panic_before_or_inside_the_future_is_its_message() {
        assert_eq!(caught(|| async { 7 }).await, Ok(7));
        let inside = caught(|| async {
            if true {
                panic!("no such order: {}", 7);
            }
        })
        .await;
        assert_eq!(inside, Err("the handler panicked: no such order: 7".into()));
        let before = caught(|| -> std::future::Ready<()> { panic!("at once") }).await;
        assert_eq!(before, Err("the handler panicked: at once".into()));
    }
}
