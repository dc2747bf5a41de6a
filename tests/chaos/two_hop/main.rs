//! The outbox's two-hop fault-injection run: messages → consumer A (`#[idempotent]` with an inbox
//! and an outbox, on PostgreSQL) → relays → RabbitMQ → consumer B (`#[idempotent]` keyed on the
//! broker's message id). Consumer processes are SIGKILLed before a delivery's handler, in its
//! body and after its commit but before its acknowledgement; relay processes before a publication,
//! after the broker's confirmation but before the batch marked it sent, and at random moments;
//! PostgreSQL restarts mid-run. The checker proves that every effect of A and of B happened
//! exactly once, none was lost, and that B processed each ordering key's messages in the order A
//! committed them.
//!
//! With `--broker kafka` the second hop is Kafka: the relays publish with the Kafka publisher
//! (the ordering key as the record's key) and B is the Kafka runner (`kafka.rs`). Without
//! `--broker`, the short run of each.
//!
//! ```text
//! cargo test --all-features --test chaos_outbox                  # the short runs CI makes
//! cargo test --release --all-features --test chaos_outbox -- \
//!     --messages 10000 --keys 50 --kill-rate 0.01 --db-restarts 4 --broker kafka
//! ```
//!
//! Needs `IDEMPOTENT_PG_URL` (restarted through `IDEMPOTENT_PG_RESTART`, which
//! `scripts/postgres start` sets) and `IDEMPOTENT_AMQP_URL`; Kafka is librdkafka's mock cluster in
//! the driver's process, or the server at `IDEMPOTENT_KAFKA_URL`. The binary is also each process:
//! the driver starts copies of itself with `consume-a`, `relay` or `consume-b`.

mod checker;
mod driver;
#[cfg(feature = "kafka")]
mod kafka;
mod roles;

use std::time::Duration;

use driver::Config;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    if let [role, queue, pg, amqp, rate, seed, ..] = args.as_slice()
        && matches!(role.as_str(), "consume-a" | "consume-b" | "relay")
    {
        let rate: f64 = rate.parse().expect("a kill rate");
        let seed: u64 = seed.parse().expect("a seed");
        runtime.block_on(async {
            match role.as_str() {
                "consume-a" => roles::consume("a", pg, amqp, queue, rate, seed).await,
                "consume-b" => roles::consume("b", pg, amqp, queue, rate, seed).await,
                _ => roles::relay(pg, amqp, rate, seed).await,
            }
        });
        std::process::exit(0);
    }
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let number = |name: &str, default: f64| flag(name).map_or(default, |v| v.parse().expect(name));
    let env = |name: &str| {
        std::env::var(name)
            .unwrap_or_else(|_| panic!("{name} is not set: run the tests with scripts/test"))
    };
    let brokers: Vec<&str> = match flag("--broker").as_deref() {
        None => vec!["rabbitmq", "kafka"],
        Some("rabbitmq") => vec!["rabbitmq"],
        Some("kafka") => vec!["kafka"],
        Some(other) => panic!("--broker is rabbitmq or kafka, not {other}"),
    };
    let mut config = Config {
        pg: String::new(),
        kafka: None,
        amqp: env("IDEMPOTENT_AMQP_URL"),
        restart: std::env::var("IDEMPOTENT_PG_RESTART").ok(),
        messages: number("--messages", 800.0) as usize,
        keys: number("--keys", 16.0) as usize,
        consumers_a: number("--consumers", 3.0) as usize,
        relays: number("--relays", 2.0) as usize,
        kill_rate: number("--kill-rate", 0.02),
        relay_random_kill_every: Duration::from_secs_f64(number("--relay-kill-every-secs", 4.0)),
        db_restarts: number("--db-restarts", 2.0) as usize,
        duplicate_share: number("--duplicate-share", 0.2),
        seed: number("--seed", 11.0) as u64,
        deadline: Duration::from_secs(number("--deadline-secs", 900.0) as u64),
    };
    if config.restart.is_none() {
        println!(
            "chaos_outbox: IDEMPOTENT_PG_RESTART is not set, so this run cannot restart PostgreSQL"
        );
        config.db_restarts = 0;
    }
    let ok = runtime.block_on(async {
        let mut ok = true;
        for broker in brokers {
            let mut config = config.clone();
            config.pg = fresh_database(&env("IDEMPOTENT_PG_URL")).await;
            ok &= match broker {
                "kafka" => {
                    // A killed B gets its partitions back about 5 s later on the mock cluster (its
                    // session times out, then the group rebalances), where RabbitMQ redelivers at
                    // once: the short run on Kafka is 300 messages (about ten kills of B).
                    if flag("--messages").is_none() {
                        config.messages = 300;
                    }
                    on_kafka(config).await
                }
                _ => run(config, driver::queues()).await,
            };
        }
        ok
    });
    if !ok {
        std::process::exit(1);
    }
}

/// The run with Kafka as the second hop.
#[cfg(feature = "kafka")]
async fn on_kafka(mut config: Config) -> bool {
    let cluster = kafka::Cluster::start();
    config.kafka = Some(cluster.servers().to_owned());
    let (queue_a, topic_b) = driver::queues();
    if let Err(error) = cluster.topics(&topic_b, 4).await {
        println!("chaos_outbox: FAILED: {error}");
        return false;
    }
    run(config, (queue_a, topic_b)).await
}

#[cfg(not(feature = "kafka"))]
async fn on_kafka(_: Config) -> bool {
    println!("chaos_outbox: --broker kafka needs the `kafka` feature");
    false
}

/// One run, with A's queue and B's queue (or topic).
async fn run(config: Config, (queue_a, queue_b): (String, String)) -> bool {
    setup(&config.pg).await;
    println!(
        "chaos_outbox: {} messages on {} ordering keys, {} consumer A processes, {} relays to {}, 1 consumer B, kill rate {}, {} PostgreSQL restarts, seed {}",
        config.messages,
        config.keys,
        config.consumers_a,
        config.relays,
        if config.kafka.is_some() {
            "Kafka"
        } else {
            "RabbitMQ"
        },
        config.kill_rate,
        config.db_restarts,
        config.seed
    );
    let outcome = match driver::run(&config, &queue_a, &queue_b).await {
        Ok(outcome) => outcome,
        Err(error) => {
            println!("chaos_outbox: FAILED: {error}");
            return false;
        }
    };
    let verdict = checker::check(&config.pg, &outcome)
        .await
        .expect("the checker reads the database");
    let f = &outcome.figures;
    println!(
        "  published to A      {} ({} producer retries)",
        f.published, f.producer_retries
    );
    println!(
        "  consumer A          {} processed, {} duplicates detected",
        f.a_processed, f.a_duplicates
    );
    println!("  outbox rows         {}", verdict.outbox_rows);
    let b_redelivered = f
        .kills
        .get("b after-commit-before-ack")
        .copied()
        .unwrap_or(0);
    println!(
        "  consumer B          {} processed, {} duplicates detected: {} redeliveries after B was killed between its commit and its ack, {} rows the relays published again",
        f.b_processed,
        f.b_duplicates,
        b_redelivered,
        f.b_duplicates.saturating_sub(b_redelivered)
    );
    println!(
        "  kills               {} {:?}",
        f.kills.values().sum::<usize>(),
        f.kills
    );
    println!(
        "  restarts            {:?} ({} unexpected exits)",
        f.restarts, f.unexpected_exits
    );
    println!(
        "  database restarts   {} {:?}",
        f.db_restarts.len(),
        f.db_restarts
    );
    let sample = |items: &[String]| {
        if items.is_empty() {
            String::new()
        } else {
            format!("  e.g. {:?}", &items[..items.len().min(3)])
        }
    };
    println!(
        "  A double / lost     {} / {}{}{}",
        verdict.a_double.len(),
        verdict.a_lost.len(),
        sample(&verdict.a_double),
        sample(&verdict.a_lost)
    );
    println!(
        "  outbox mismatches   {}{}",
        verdict.outbox_mismatches.len(),
        sample(&verdict.outbox_mismatches)
    );
    println!(
        "  B double / lost     {} / {}{}{}",
        verdict.b_double.len(),
        verdict.b_lost.len(),
        sample(&verdict.b_double),
        sample(&verdict.b_lost)
    );
    println!(
        "  keys out of order   {} of {}{}",
        verdict.out_of_order.len(),
        verdict.keys,
        sample(&verdict.out_of_order)
    );
    println!("  elapsed             {:.1?}", f.elapsed);
    let ok = verdict.violations() == 0 && f.unexpected_exits == 0;
    println!("chaos_outbox: {}", if ok { "passed" } else { "FAILED" });
    ok
}

async fn fresh_database(base: &str) -> String {
    use sqlx::Connection;
    let name = format!("chaos_outbox_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(base).await.expect("PostgreSQL");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .expect("CREATE DATABASE");
    let (prefix, _) = base.rsplit_once('/').expect("a database in the URL");
    format!("{prefix}/{name}")
}

/// A's and B's tables and inboxes (A's with its outbox).
async fn setup(url: &str) {
    let pool = sqlx::PgPool::connect(url).await.expect("PostgreSQL");
    for statement in [
        "CREATE TABLE a_keys (key TEXT PRIMARY KEY, n BIGINT NOT NULL)",
        "CREATE TABLE a_effects (message_id TEXT NOT NULL, key TEXT NOT NULL, n BIGINT NOT NULL)",
        "CREATE TABLE b_keys (key TEXT PRIMARY KEY, n BIGINT NOT NULL)",
        "CREATE TABLE b_effects (message_id TEXT NOT NULL, key TEXT NOT NULL, n BIGINT NOT NULL, b_seq BIGINT NOT NULL)",
    ] {
        sqlx::query(statement)
            .execute(&pool)
            .await
            .expect(statement);
    }
    let a = idempotent::Inbox::new(pool.clone());
    a.migrate().await.expect("migrate A");
    let b = a.clone().with_table("b_inbox").expect("a table name");
    b.migrate().await.expect("migrate B");
    pool.close().await;
}
