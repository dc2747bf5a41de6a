//! Consumes payment events from NATS JetStream with an `#[idempotent]` handler, through the broker
//! runner, which settles each delivery by its outcome: `Processed` or `Duplicate` → acknowledged
//! (and the acknowledgement confirmed by the server); a retryable error → `nak` with a back-off
//! delay, at most five attempts; any other error, or no `Nats-Msg-Id` → dead-lettered to
//! `<stream>.dead` with the reason in a header, then terminated.
//!
//! ```text
//! cargo run --example nats_consumer --features nats -- --stream PAYMENTS                 # SQLite
//! DATABASE_URL=postgres://… cargo run --example nats_consumer --features nats,postgres -- --stream PAYMENTS
//! ```
//!
//! `--workers N` runs N handlers at once (1 by default); `--ack-wait SECONDS` is how long JetStream
//! waits for an acknowledgement before it delivers a message again (30 by default, set when the
//! consumer is created); `--exit-when-idle SECONDS` stops once no delivery came for that long;
//! `--pause-after-commit N` stops after the N-th commit, before its acknowledgement, and says so on
//! stdout (for the test that kills it there).
//!
//! The NATS client reconnects by itself when the server restarts, and the runner carries on with
//! it: no restart loop here. It ends only on request (`--exit-when-idle`), or with an error when
//! its consumer or stream is deleted.

#[path = "nats/common.rs"]
mod common;
#[path = "payments/ledger.rs"]
mod ledger;

use std::sync::Arc;
use std::time::Duration;

use common::{ledger_consumer, streams};
use idempotent::broker::Shutdown;
use idempotent::broker::nats::Runner;
use ledger::{Ledger, arg, report, stop_when_idle, worker};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let stream = arg("--stream").unwrap_or_else(|| "PAYMENTS".into());
    let workers: usize = arg("--workers").map_or(Ok(1), |n| n.parse())?;
    let idle = arg("--exit-when-idle").map(|s| Duration::from_secs(s.parse().expect("seconds")));
    let pause_after: Option<usize> = arg("--pause-after-commit").map(|n| n.parse().expect("N"));
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "sqlite://ledger.db".into());
    let ledger = Ledger::open(&url).await?;

    let (jetstream, payments) = streams(&stream).await?;
    let ack_wait = arg("--ack-wait").map_or(Ok(30), |s| s.parse())?;
    let consumer = ledger_consumer(&payments, Duration::from_secs(ack_wait)).await?;
    let shutdown = Shutdown::new();
    let runner = Runner::new(jetstream, consumer, format!("{stream}.dead"))
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
