//! Consumes payment events from a Kafka topic with an `#[idempotent]` handler, through the broker
//! runner, in consumer group `ledger`, which settles each record by its outcome and commits its
//! offset only then (per partition in order):
//!
//! - `Processed` or `Duplicate`: committed (the effect is committed, by this record or an earlier
//!   copy);
//! - a retryable error: produced to a retry topic (`ledger.retry.<delay>ms`) and tried again once
//!   its delay has passed, at most five times, without holding back the rest of its partition;
//! - any other error, or no `message-id` header: produced to `<topic>.dead` with the reason in a
//!   header.
//!
//! The key is the producer's `message-id` header, never topic, partition and offset: a record
//! produced twice has two offsets.
//!
//! ```text
//! KAFKA_BROKERS=127.0.0.1:9092 cargo run --example kafka_consumer --features kafka -- --topic payments
//! DATABASE_URL=postgres://… cargo run --example kafka_consumer --features kafka,postgres -- --topic payments
//! ```
//!
//! `--workers N` runs N handlers at once, on different partitions (1 by default);
//! `--session-timeout SECONDS` is how long the group waits for a consumer that stopped answering
//! before it gives its partitions to the others (Kafka's `session.timeout.ms`, 45 s by default):
//! a killed consumer's partitions are consumed again after it, from their committed offsets;
//! `--exit-when-idle SECONDS` stops once no record came for that long, committing what is done;
//! `--pause-after-commit N` stops after the N-th commit, before its offset is committed, and says
//! so on stdout (for the test that kills it there).

#[path = "kafka/common.rs"]
mod common;
#[path = "payments/ledger.rs"]
mod ledger;

use std::sync::Arc;
use std::time::Duration;

use common::{client, topic};
use idempotent::broker::Shutdown;
use idempotent::broker::kafka::Runner;
use ledger::{Ledger, arg, report, stop_when_idle, worker};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let name = arg("--topic").unwrap_or_else(|| "payments".into());
    let workers: usize = arg("--workers").map_or(Ok(1), |n| n.parse())?;
    let idle = arg("--exit-when-idle").map(|s| Duration::from_secs(s.parse().expect("seconds")));
    let pause_after: Option<usize> = arg("--pause-after-commit").map(|n| n.parse().expect("N"));
    let session: u64 = arg("--session-timeout").map_or(Ok(45), |s| s.parse())?;
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "sqlite://ledger.db".into());
    let ledger = Ledger::open(&url).await?;

    let mut client = client();
    topic(&client, &name, 4).await?;
    client
        .set("session.timeout.ms", (session * 1000).to_string())
        .set("heartbeat.interval.ms", (session * 1000 / 10).to_string());
    let shutdown = Shutdown::new();
    let runner = Runner::new(client, "ledger", &[name.as_str()], format!("{name}.dead"))
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
