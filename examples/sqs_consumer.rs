//! Consumes payment events from an SQS queue with an `#[idempotent]` handler, through the broker
//! runner, which settles each message by its outcome: `Processed` or `Duplicate` → deleted; a
//! retryable error → hidden for a back-off (its visibility timeout), at most five attempts; any
//! other error, or no `message-id` attribute → sent to the queue's dead-letter queue (its redrive
//! policy's) with the reason in an attribute, then deleted.
//!
//! ```text
//! scripts/sqs start     # a local SQS; prints the IDEMPOTENT_SQS_URL to export
//! cargo run --example sqs_consumer --features sqs -- --queue payments                    # SQLite
//! DATABASE_URL=postgres://… cargo run --example sqs_consumer --features sqs,postgres -- --queue payments
//! ```
//!
//! `--workers N` runs N handlers at once (1 by default); `--visibility-timeout SECONDS` is how long
//! a received message stays hidden from other consumers (30 by default, set when the queue is
//! created): a killed consumer's message comes back after it; `--exit-when-idle SECONDS` stops
//! once no message came for that long; `--pause-after-commit N` stops after the N-th commit, before
//! its delete, and says so on stdout (for the test that kills it there).

#[path = "sqs/common.rs"]
mod common;
#[path = "payments/ledger.rs"]
mod ledger;

use std::sync::Arc;
use std::time::Duration;

use common::{client, queues};
use idempotent::broker::Shutdown;
use idempotent::broker::sqs::Runner;
use ledger::{Ledger, arg, report, stop_when_idle, worker};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let queue = arg("--queue").unwrap_or_else(|| "payments".into());
    let workers: usize = arg("--workers").map_or(Ok(1), |n| n.parse())?;
    let idle = arg("--exit-when-idle").map(|s| Duration::from_secs(s.parse().expect("seconds")));
    let pause_after: Option<usize> = arg("--pause-after-commit").map(|n| n.parse().expect("N"));
    let visibility: u64 = arg("--visibility-timeout").map_or(Ok(30), |v| v.parse())?;
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "sqlite://ledger.db".into());
    let ledger = Ledger::open(&url).await?;

    let client = client();
    let queue_url = queues(&client, &queue, visibility).await?;
    let shutdown = Shutdown::new();
    let runner = Runner::new(client, queue_url)
        .workers(workers)
        .wait_time(Duration::from_secs(1))
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
