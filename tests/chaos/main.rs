//! The fault-injection run: an at-least-once broker, several consumer *processes* running
//! `#[idempotent]` handlers, SIGKILLs at every point of a delivery, database restarts, and a
//! checker that proves each effect happened exactly once.
//!
//! ```text
//! cargo test --all-features --test chaos                        # the short runs CI makes
//! cargo test --release --all-features --test chaos -- \
//!     --backend postgres --messages 10000 --consumers 4 --kill-rate 0.006 --db-restarts 3
//! ```
//!
//! Without `--backend` it runs both short versions: PostgreSQL (`IDEMPOTENT_PG_URL`, restarted
//! through `IDEMPOTENT_PG_RESTART`, which `scripts/postgres start` sets) and SQLite (several
//! processes on one database file). The binary is also the consumer: the driver starts copies of
//! itself with `consumer <url>`.

mod checker;
mod consumer;
mod driver;
mod protocol;

use std::time::Duration;

use driver::Config;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    if args.first().map(String::as_str) == Some("consumer") {
        runtime.block_on(consumer::run(&args[1]));
        // Without waiting for the runtime's idle threads: the broker has closed our stdin.
        std::process::exit(0);
    }
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let number = |name: &str, default: f64| flag(name).map_or(default, |v| v.parse().expect(name));
    let backends: Vec<String> = match flag("--backend") {
        Some(backend) => vec![backend],
        None => vec!["postgres".into(), "sqlite".into()],
    };
    let mut passed = 0;
    let mut failed = 0;
    for backend in backends {
        // SQLite serializes writers, so its run is half as long.
        let short = backend == "sqlite";
        let config = Config {
            url: String::new(),
            restart: None,
            messages: number("--messages", if short { 1500.0 } else { 3000.0 }) as usize,
            consumers: number("--consumers", 4.0) as usize,
            prefetch: number("--prefetch", 2.0) as usize,
            kill_rate: number("--kill-rate", 0.01),
            db_restarts: number("--db-restarts", 3.0) as usize,
            duplicate_share: number("--duplicate-share", 0.35),
            seed: number("--seed", 7.0) as u64,
            deadline: Duration::from_secs(number("--deadline-secs", 900.0) as u64),
        };
        let ok = runtime.block_on(run(&backend, config));
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
async fn run(backend: &str, mut config: Config) -> bool {
    let _dir;
    match backend {
        "postgres" => {
            let base = std::env::var("IDEMPOTENT_PG_URL").expect(
                "IDEMPOTENT_PG_URL is not set: run the tests with scripts/test, which starts PostgreSQL",
            );
            config.url = fresh_postgres_database(&base).await;
            config.restart = std::env::var("IDEMPOTENT_PG_RESTART").ok();
            if config.restart.is_none() {
                println!(
                    "chaos: IDEMPOTENT_PG_RESTART is not set, so this run cannot restart PostgreSQL"
                );
                config.db_restarts = 0;
            }
        }
        "sqlite" => {
            let dir = tempfile::tempdir().expect("a temporary folder");
            config.url = format!("sqlite://{}", dir.path().join("chaos.db").display());
            config.db_restarts = 0;
            _dir = dir;
        }
        other => panic!("unknown backend {other}"),
    }
    setup(&config.url).await;
    println!(
        "chaos on {backend}: {} messages, {} consumer processes, kill rate {}, {} database restarts, seed {}",
        config.messages, config.consumers, config.kill_rate, config.db_restarts, config.seed
    );
    let outcome = match driver::run(&config).await {
        Ok(outcome) => outcome,
        Err(error) => {
            println!("chaos on {backend}: FAILED: {error}");
            return false;
        }
    };
    let verdict = checker::check(&config.url, &outcome)
        .await
        .expect("the checker reads the database");
    let f = &outcome.figures;
    let duplicates: usize = f
        .published
        .iter()
        .filter(|(why, _)| why.as_str() != "First")
        .map(|(_, n)| n)
        .sum();
    let firsts = f.published.get("First").copied().unwrap_or(0);
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
    println!(
        "  database restarts   {} {:?}",
        f.db_restarts.len(),
        f.db_restarts
    );
    println!("  inbox rows          {}", verdict.inbox_rows);
    println!(
        "  counter             {} (expected {})",
        verdict.counter.0, verdict.counter.1
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
    println!("  elapsed             {:.1?}", f.elapsed);
    verdict.violations() == 0 && f.unexpected_exits == 0 && f.unexpected_failures == 0
}

fn sample(items: &[String]) -> String {
    if items.is_empty() {
        String::new()
    } else {
        format!("  e.g. {:?}", &items[..items.len().min(3)])
    }
}

async fn fresh_postgres_database(base: &str) -> String {
    use sqlx::Connection;
    let name = format!("chaos_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(base).await.expect("PostgreSQL");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .expect("CREATE DATABASE");
    let (prefix, _) = base.rsplit_once('/').expect("a database in the URL");
    format!("{prefix}/{name}")
}

/// The run's tables, the inbox and the counter.
async fn setup(url: &str) {
    const TABLES: [&str; 4] = [
        "CREATE TABLE chaos_ledger (message_id TEXT NOT NULL, tag BIGINT NOT NULL)",
        "CREATE TABLE chaos_emails (message_id TEXT NOT NULL, tag BIGINT NOT NULL)",
        "CREATE TABLE chaos_counter (name TEXT PRIMARY KEY, value BIGINT NOT NULL)",
        "INSERT INTO chaos_counter (name, value) VALUES ('ledger', 0)",
    ];
    if url.starts_with("postgres") {
        create(
            sqlx::PgPool::connect(url).await.expect("PostgreSQL"),
            &TABLES,
        )
        .await;
    } else {
        let options = idempotent::sqlite::connect_options(url).unwrap();
        create(
            sqlx::SqlitePool::connect_with(options)
                .await
                .expect("SQLite"),
            &TABLES,
        )
        .await;
    }
}

async fn create<DB: idempotent::Backend>(pool: sqlx::Pool<DB>, tables: &[&'static str])
where
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
{
    for &statement in tables {
        sqlx::raw_sql(statement)
            .execute(&pool)
            .await
            .expect(statement);
    }
    idempotent::Inbox::new(pool)
        .migrate()
        .await
        .expect("migrate");
}
