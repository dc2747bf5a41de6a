//! The outbox's wake-up: a `LISTEN` on the channel its writers `NOTIFY` when they commit.

use std::sync::Arc;

/// Listens on `channel` and calls `wake` for each notification, and once after each reconnection
/// (the notifications sent meanwhile are lost); reconnects after failures, for ever.
pub(super) async fn listen(pool: sqlx::PgPool, channel: String, wake: Arc<dyn Fn() + Send + Sync>) {
    use sqlx::postgres::PgListener;
    let mut pause = std::time::Duration::from_millis(100);
    loop {
        let mut listening = false;
        let failed: Result<std::convert::Infallible, sqlx::Error> = async {
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.listen(&channel).await?;
            listening = true;
            // Rows committed before the LISTEN took effect notified nobody.
            wake();
            loop {
                // `None`: the connection was lost and is back; what was notified meanwhile is
                // gone, so wake up either way.
                listener.try_recv().await?;
                wake();
            }
        }
        .await;
        let Err(error) = failed;
        tracing::debug!(%channel, %error, "the outbox's listener failed; relays poll meanwhile");
        wake();
        if listening {
            pause = std::time::Duration::from_millis(100);
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(std::time::Duration::from_secs(5));
    }
}
