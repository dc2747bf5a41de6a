//! Consumes payment events from RabbitMQ with an `#[idempotent]` handler, through the broker
//! runner, which settles each delivery by its outcome:
//!
//! - `Processed` or `Duplicate`: acknowledge (the effect is committed, by this delivery or an
//!   earlier one);
//! - a retryable error (deadlock, busy database, lost connection): try again after a back-off,
//!   through a delay queue, at most five times;
//! - any other error (the handler's own, a payload that is not a payment, no message id):
//!   dead-letter to `<queue>.dead`, with the reason in a header.
//!
//! The key is the producer's `message_id` property, never the delivery tag: the broker gives every
//! delivery a new tag, and restarts counting on every channel.
//!
//! The runner makes its own connection (`Runner::connect`) and makes it again when the broker
//! restarts: no restart loop here. It ends only on request (`--exit-when-idle`), or with an error
//! when the broker cancels its consumer (the queue was deleted).
//!
//! ```text
//! cargo run --example rabbitmq_consumer --features rabbitmq -- --queue payments                  # SQLite
//! DATABASE_URL=postgres://… cargo run --example rabbitmq_consumer --features rabbitmq,postgres -- --queue payments
//! ```
//!
//! `--workers N` runs N handlers at once (1 by default); `--exit-when-idle SECONDS` stops once no
//! delivery came for that long; `--pause-after-commit N` stops after the N-th commit, before its
//! acknowledgement, and says so on stdout (for the test that kills it there).

#[path = "rabbitmq/common.rs"]
mod common;
#[path = "payments/ledger.rs"]
mod ledger;

use std::sync::Arc;
use std::time::Duration;

use common::{amqp_url, channel};
use idempotent::broker::Shutdown;
use idempotent::broker::rabbitmq::Runner;
use ledger::{Ledger, arg, report, stop_when_idle, worker};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let queue = arg("--queue").unwrap_or_else(|| "payments".into());
    let workers: usize = arg("--workers").map_or(Ok(1), |n| n.parse())?;
    let idle = arg("--exit-when-idle").map(|s| Duration::from_secs(s.parse().expect("seconds")));
    let pause_after: Option<usize> = arg("--pause-after-commit").map(|n| n.parse().expect("N"));
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "sqlite://ledger.db".into());
    let ledger = Ledger::open(&url).await?;

    // The queue, declared once; the runner then connects (and reconnects) by itself.
    let (connection, _channel) = channel(&queue).await?;
    connection.close(200, "declared".into()).await?;
    let shutdown = Shutdown::new();
    let runner = Runner::connect(amqp_url(), queue.as_str())
        .workers(workers)
        .shutdown_on(shutdown.clone());
    if let Some(idle) = idle {
        stop_when_idle(runner.stats(), idle, shutdown);
    }
    let commits = Arc::default();
    let stats = runner
        .run(|| worker(&ledger, &commits, pause_after))
        .await?;
    report(stats);
    Ok(())
}
