//! The fault-injection run: an at-least-once broker, several consumer *processes* running
//! `#[idempotent]` handlers, SIGKILLs at every point of a delivery, the database's own faults
//! (restarts, Galera nodes killed and restarted, PostgreSQL failovers), and a checker that proves
//! each effect happened exactly once.
//!
//! ```text
//! cargo test --all-features --test chaos                        # the short runs CI makes
//! cargo test --release --all-features --test chaos -- \
//!     --backend postgres --messages 10000 --consumers 4 --kill-rate 0.006 --faults 3
//! ```
//!
//! Backends (`--backend`; without it, the short run of each one whose servers are there):
//! - `postgres` (`IDEMPOTENT_PG_URL`, restarted through `IDEMPOTENT_PG_RESTART`, which
//!   `scripts/postgres start` sets) and `sqlite` (several processes on one database file): always;
//! - `mysql`: a single MariaDB (`IDEMPOTENT_MYSQL_URL`), not restarted: the baseline of `galera`;
//! - `galera`: the three nodes of `scripts/galera` (`IDEMPOTENT_GALERA_URLS`), consumers spread
//!   over them (`--spread 1` puts them all on node 1), nodes killed and restarted one at a time;
//! - `postgres-ha-sync`, `postgres-ha-async`: the primary and standby of `scripts/postgres-ha`
//!   (`IDEMPOTENT_PG_HA_CTL`), started afresh in that replication mode, the primary SIGKILLed and
//!   the standby promoted mid-run; the asynchronous run then republishes every message, and checks
//!   that what the failovers lost, they lost whole (effect and inbox row together);
//! - `pgbouncer`: PostgreSQL through PgBouncer in transaction mode (`scripts/pgbouncer`).
//!
//! The binary is also the consumer: the driver starts copies of itself with
//! `consumer <kind> <urls>`.

mod backends;
mod checker;
mod consumer;
mod driver;
mod failover;
mod protocol;

use std::collections::HashSet;
use std::time::Duration;

use driver::{Config, Outcome, Plan};

/// A backend's short run: messages, consumer processes, faults.
fn short_run(backend: &str) -> (f64, f64, f64) {
    match backend {
        "postgres" => (3000.0, 4.0, 3.0),
        // SQLite serializes writers, so its run is half as long.
        "sqlite" | "mysql" => (1500.0, 4.0, 0.0),
        // Each node restart takes 10 to 20 s: two fit in the short run.
        "galera" => (1500.0, 6.0, 2.0),
        "postgres-ha-sync" | "postgres-ha-async" | "pgbouncer" => (2000.0, 4.0, 2.0),
        other => panic!("unknown backend {other}"),
    }
}

/// The backends whose servers the environment points to.
fn present_backends() -> Vec<String> {
    let mut backends = vec!["postgres".to_owned(), "sqlite".to_owned()];
    let set = |name: &str| std::env::var_os(name).is_some();
    if set("IDEMPOTENT_MYSQL_URL") {
        backends.push("mysql".into());
    }
    if set("IDEMPOTENT_GALERA_URLS") && set("IDEMPOTENT_GALERA_CTL") {
        backends.push("galera".into());
    }
    if set("IDEMPOTENT_PG_HA_CTL") {
        backends.push("postgres-ha-sync".into());
        backends.push("postgres-ha-async".into());
    }
    if set("IDEMPOTENT_PGBOUNCER_URL") {
        backends.push("pgbouncer".into());
    }
    backends
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    if args.first().map(String::as_str) == Some("consumer") {
        runtime.block_on(consumer::run(&args[1], &args[2]));
        // Without waiting for the runtime's idle threads: the broker has closed our stdin.
        std::process::exit(0);
    }
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let number = |names: &[&str], default: f64| {
        names
            .iter()
            .find_map(|name| flag(name))
            .map_or(default, |v| v.parse().expect(names[0]))
    };
    let backends: Vec<String> = match flag("--backend") {
        Some(backend) => vec![backend],
        None => present_backends(),
    };
    let mut passed = 0;
    let mut failed = 0;
    for backend in backends {
        let (messages, consumers, faults) = short_run(&backend);
        let config = Config {
            targets: Vec::new(),
            faults: Vec::new(),
            messages: number(&["--messages"], messages) as usize,
            consumers: number(&["--consumers"], consumers) as usize,
            prefetch: number(&["--prefetch"], 2.0) as usize,
            kill_rate: number(&["--kill-rate"], 0.01),
            duplicate_share: number(&["--duplicate-share"], 0.35),
            seed: number(&["--seed"], 7.0) as u64,
            deadline: Duration::from_secs(number(&["--deadline-secs"], 900.0) as u64),
            progress: args.iter().any(|a| a == "--progress"),
        };
        let faults = number(&["--faults", "--db-restarts"], faults) as usize;
        let spread = number(&["--spread"], 3.0) as usize;
        let ok = runtime.block_on(run(&backend, config, faults, spread));
        if ok {
            passed += 1;
        } else {
            failed += 1;
        }
    }
    println!("chaos: {passed} passed, {failed} failed");
    if failed > 0 {
        std::process::exit(1);
    }
}

/// Prepares a fresh database, runs the driver, checks, prints the figures; `true` when the run
/// upheld the guarantee.
async fn run(backend: &str, mut config: Config, faults: usize, spread: usize) -> bool {
    let prepared = backends::prepare(backend, faults, spread).await;
    for note in &prepared.notes {
        println!("chaos: {note}");
    }
    config.targets = prepared.targets.clone();
    config.faults = prepared.faults.clone();
    println!(
        "chaos on {backend}: {} messages, {} consumer processes, kill rate {}, {} faults, seed {}",
        config.messages,
        config.consumers,
        config.kill_rate,
        config.faults.len(),
        config.seed
    );
    let outcome = match driver::run(&config, Plan::Chaos).await {
        Ok(outcome) => outcome,
        Err(error) => {
            println!("chaos on {backend}: FAILED: {error}");
            return false;
        }
    };
    let url = prepared.check.url();
    let verdict = checker::check(&url, prepared.causal, &outcome)
        .await
        .expect("the checker reads the database");
    report(&outcome, &verdict);
    println!(
        "  faults run          {} of {} planned",
        outcome.figures.faults.len(),
        config.faults.len()
    );
    let sound = outcome.figures.unexpected_exits == 0 && outcome.figures.unexpected_failures == 0;
    if backend != "postgres-ha-async" {
        return sound && verdict.violations() == 0;
    }

    // Asynchronous replication: what the primary committed and the standby had not received is
    // gone after the failover, acknowledged or not. The inbox row and the effect are one
    // transaction, so they are gone together; the broker has forgotten the acknowledged ones, so
    // a producer that publishes everything again is what brings them back.
    let lost_whole = verdict.neither;
    println!(
        "  failover cost       {lost_whole} (message, consumer) pairs lost whole, effect and inbox row together; \
         {} acknowledged; both-or-neither breaches {}",
        verdict.lost.len(),
        verdict.consistency_violations()
    );
    let consistent = verdict.consistency_violations() == 0;
    let again = Config {
        kill_rate: 0.0,
        faults: Vec::new(),
        duplicate_share: 0.0,
        ..config
    };
    println!("chaos on {backend}: every message published again");
    let replay = match driver::run(&again, Plan::Republish(&outcome.messages)).await {
        Ok(replay) => replay,
        Err(error) => {
            println!("chaos on {backend}: FAILED: {error}");
            return false;
        }
    };
    let merged = Outcome {
        acked: outcome.acked.union(&replay.acked).copied().collect(),
        dead_letters: replay
            .dead_letters
            .union(&outcome.dead_letters)
            .copied()
            .collect::<HashSet<_>>(),
        messages: outcome.messages,
        figures: replay.figures,
    };
    let verdict = checker::check(&prepared.check.url(), false, &merged)
        .await
        .expect("the checker reads the database");
    report(&merged, &verdict);
    let processed_again = merged.figures.processed;
    println!(
        "  processed again     {processed_again} (the pairs lost whole: {lost_whole}); the rest were duplicates"
    );
    sound
        && consistent
        && processed_again == lost_whole
        && merged.figures.unexpected_failures == 0
        && verdict.violations() == 0
}

fn report(outcome: &Outcome, verdict: &checker::Verdict) {
    let f = &outcome.figures;
    let duplicates: usize = f
        .published
        .iter()
        .filter(|(why, _)| !matches!(why.as_str(), "First" | "Republished"))
        .map(|(_, n)| n)
        .sum();
    let firsts: usize = f
        .published
        .iter()
        .filter(|(why, _)| matches!(why.as_str(), "First" | "Republished"))
        .map(|(_, n)| n)
        .sum();
    println!("  published           {:?}", f.published);
    println!(
        "  duplicate share     {:.1}% of publications are extra copies ({duplicates} of {})",
        100.0 * duplicates as f64 / firsts as f64,
        firsts
    );
    println!("  deliveries          {}", f.deliveries);
    println!(
        "  outcomes            {} processed, {} duplicates reported, {} retryable nacks, {} handler failures, {} dead-lettered",
        f.processed, f.duplicates_reported, f.nacks_retryable, f.nacks_failed, f.dead_lettered
    );
    println!(
        "  kills               {} {:?}",
        f.kills.values().sum::<usize>(),
        f.kills
    );
    println!(
        "  consumer restarts   {} ({} unexpected exits)",
        f.consumer_restarts, f.unexpected_exits
    );
    println!("  database faults     {} {:?}", f.faults.len(), f.faults);
    println!("  inbox rows          {}", verdict.inbox_rows);
    println!(
        "  counter             {} (expected {}; ledger rows {})",
        verdict.counter.0, verdict.counter.1, verdict.counter_against_rows.1
    );
    println!(
        "  both or neither     {} both, {} neither, {} half{}",
        verdict.both,
        verdict.neither,
        verdict.half.len(),
        sample(&verdict.half)
    );
    println!(
        "  double effects      {}{}",
        verdict.double_effects.len(),
        sample(&verdict.double_effects)
    );
    println!(
        "  lost                {}{}",
        verdict.lost.len(),
        sample(&verdict.lost)
    );
    println!(
        "  poison marked done  {}{}",
        verdict.poison_marked_done.len(),
        sample(&verdict.poison_marked_done)
    );
    println!(
        "  inbox mismatches    {}{}",
        verdict.inbox_mismatches.len(),
        sample(&verdict.inbox_mismatches)
    );
    println!(
        "  misclassified       {} (errors not retryable for messages that always succeed)",
        f.unexpected_failures
    );
    let handled = f.processed + f.duplicates_reported;
    println!(
        "  elapsed             {:.1?} ({:.0} acknowledged deliveries/s)",
        f.elapsed,
        handled as f64 / f.elapsed.as_secs_f64()
    );
}

fn sample(items: &[String]) -> String {
    if items.is_empty() {
        String::new()
    } else {
        format!("  e.g. {:?}", &items[..items.len().min(3)])
    }
}
