//! What the inbox costs per message, measured against the alternatives in one run, on the same
//! database, pool size and messages; prints a table and further figures, then writes the plot
//! `bench.svg` into cargo's target directory.
//!
//! ```text
//! cargo bench --bench inbox --features postgres            # PostgreSQL (IDEMPOTENT_PG_URL) and SQLite
//! cargo bench --bench inbox --features postgres -- --big-inbox 10000000 --purge 1000000
//! cargo bench --bench inbox --features postgres -- --bloat 10000000 [--cycles 6]   # only the purge's bloat study
//! ```
//!
//! The handler's work is one `UPDATE` of a random row of 10,000. The variants:
//! (a) no inbox, its own transaction: fast, and wrong under duplicates;
//! (b) the `#[idempotent]` handler;
//! (c) the background article's check-then-insert: `SELECT` the key, `UPDATE`, `INSERT` the key,
//!     retrying on a unique violation.
//! Each runs with 1, 4, 8 and 16 workers (a pool of as many connections), with 0% and 20% of the
//! deliveries duplicates of earlier ones. Ratios, not absolute times, are the result.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idempotent::Inbox;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const ACCOUNTS: i64 = 10_000;

/// One delivery of a message.
#[derive(Clone)]
pub struct Transfer {
    pub message_id: uuid::Uuid,
    pub account: i64,
}

macro_rules! variants_on {
    ($conn:ty, $db:ty, $checked_insert:literal) => {
        use super::Transfer;
        use idempotent::idempotent;

        /// (a) no inbox.
        pub async fn plain(conn: &mut $conn, msg: &Transfer) -> Result<(), sqlx::Error> {
            let mut tx = sqlx::Connection::begin(conn).await?;
            sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = $1")
                .bind(msg.account)
                .execute(&mut *tx)
                .await?;
            tx.commit().await
        }

        /// (b) the inbox.
        #[idempotent(key = "message_id", consumer = "bench")]
        pub async fn inbox(tx: &mut $conn, msg: &Transfer) -> Result<(), sqlx::Error> {
            sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = $1")
                .bind(msg.account)
                .execute(&mut *tx)
                .await?;
            Ok(())
        }

        /// (c) check, then insert, relying on the unique index and retrying on a violation (and,
        /// as a consumer would redeliver it, on a busy SQLite: a deferred transaction that read
        /// first cannot wait for the write lock).
        pub async fn check_then_insert(
            conn: &mut $conn,
            msg: &Transfer,
        ) -> Result<(), sqlx::Error> {
            loop {
                match check_then_insert_once(conn, msg).await {
                    Err(e) if idempotent::is_retryable(&e) => continue,
                    other => return other,
                }
            }
        }

        async fn check_then_insert_once(
            conn: &mut $conn,
            msg: &Transfer,
        ) -> Result<(), sqlx::Error> {
            let key = idempotent::message_key(&msg.message_id).expect("a UUID key");
            loop {
                let mut tx = sqlx::Connection::begin(&mut *conn).await?;
                let seen: Option<i32> = sqlx::query_scalar(
                    "SELECT 1 FROM idempotent_inbox WHERE consumer = 'bench' AND message_key = $1",
                )
                .bind(key.as_bytes())
                .fetch_optional(&mut *tx)
                .await?;
                if seen.is_some() {
                    return Ok(());
                }
                sqlx::query("UPDATE accounts SET balance = balance + 1 WHERE id = $1")
                    .bind(msg.account)
                    .execute(&mut *tx)
                    .await?;
                let inserted = sqlx::query($checked_insert)
                    .bind(key.as_bytes())
                    .execute(&mut *tx)
                    .await;
                match inserted {
                    Ok(_) => return tx.commit().await,
                    Err(sqlx::Error::Database(e)) if e.is_unique_violation() => continue,
                    Err(e) => return Err(e),
                }
            }
        }
    };
}

mod on_postgres {
    variants_on!(
        sqlx::PgConnection,
        sqlx::Postgres,
        "INSERT INTO idempotent_inbox (consumer, message_key) VALUES ('bench', $1)"
    );
}

mod on_sqlite {
    variants_on!(
        sqlx::SqliteConnection,
        sqlx::Sqlite,
        "INSERT INTO idempotent_inbox (consumer, message_key, processed_at) \
         VALUES ('bench', $1, CAST(unixepoch('subsec') * 1000 AS INTEGER))"
    );
}

/// Measures the three variants with 1, 4, 8 and 16 workers, 0% and 20% duplicates, and each
/// worker taking a connection from the pool per message or holding one (for (b):
/// `Inbox::for_worker`) on one backend: `$module` holds its handlers, `$connect(workers)` opens a
/// pool of that size.
macro_rules! measure {
    ($results:ident, $backend:literal, $module:ident, $count:expr, $int:literal, $connect:expr) => {
        for workers in [1, 4, 8, 16] {
            let pool = $connect(workers).await?;
            setup(&pool, $int).await;
            let inbox = Inbox::new(pool.clone());
            inbox.migrate().await?;
            for held in [false, true] {
                for share in [0, 20] {
                    let batch = Arc::new(deliveries($count, share, 7 + workers as u64));
                    for variant in [Variant::Plain, Variant::Inbox, Variant::CheckThenInsert] {
                        reset(&pool).await;
                        let (per_second, latencies) =
                            run_variant!($module, inbox, variant, held, workers, batch.clone());
                        $results.push(Measured {
                            backend: $backend,
                            workers,
                            held,
                            duplicates: share,
                            variant,
                            per_second,
                            p50: percentile(&latencies, 0.5),
                            p99: percentile(&latencies, 0.99),
                        });
                    }
                }
            }
            pool.close().await;
        }
    };
}

/// Runs one variant over a batch of deliveries on `$workers` tasks, each taking a connection from
/// the pool per message or holding one (`$held`); its throughput and latencies. `$module` holds
/// the backend's handlers.
macro_rules! run_variant {
    ($module:ident, $inbox:expr, $variant:expr, $held:expr, $workers:expr, $batch:expr) => {{
        let variant: Variant = $variant;
        let state: Arc<Vec<Worker<_>>> =
            Arc::new((0..$workers).map(|_| Worker::new(&$inbox, $held)).collect());
        drive($batch, $workers, move |worker, msg| {
            let state = state.clone();
            async move {
                let worker = &state[worker];
                match variant {
                    Variant::Inbox => drop($module::inbox(&worker.inbox, &msg).await.unwrap()),
                    Variant::Plain => {
                        let mut conn = worker.connection().await;
                        $module::plain(&mut conn, &msg).await.unwrap();
                        worker.put_back(conn).await;
                    }
                    Variant::CheckThenInsert => {
                        let mut conn = worker.connection().await;
                        $module::check_then_insert(&mut conn, &msg).await.unwrap();
                        worker.put_back(conn).await;
                    }
                }
            }
        })
        .await
    }};
}

/// What one worker task uses: its inbox, and the connection it holds (when it holds one).
struct Worker<DB: idempotent::Backend> {
    inbox: Inbox<DB>,
    held: Option<tokio::sync::Mutex<Option<sqlx::pool::PoolConnection<DB>>>>,
}

impl<DB: idempotent::Backend> Worker<DB> {
    fn new(inbox: &Inbox<DB>, held: bool) -> Self {
        if held {
            Self {
                inbox: inbox.for_worker(),
                held: Some(tokio::sync::Mutex::new(None)),
            }
        } else {
            Self {
                inbox: inbox.clone(),
                held: None,
            }
        }
    }

    /// The held connection, or one from the pool.
    async fn connection(&self) -> sqlx::pool::PoolConnection<DB> {
        let kept = match &self.held {
            Some(held) => held.lock().await.take(),
            None => None,
        };
        match kept {
            Some(conn) => conn,
            None => self.inbox.pool().acquire().await.unwrap(),
        }
    }

    /// Holds `conn` again, or hands it back to the pool.
    async fn put_back(&self, conn: sqlx::pool::PoolConnection<DB>) {
        if let Some(held) = &self.held {
            *held.lock().await = Some(conn);
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    Plain,
    Inbox,
    CheckThenInsert,
}

/// One measurement: deliveries per second, and latency percentiles.
#[derive(Clone, Debug)]
struct Measured {
    backend: &'static str,
    workers: usize,
    /// Each worker holds a connection, rather than taking one from the pool per message.
    held: bool,
    duplicates: u32,
    variant: Variant,
    per_second: f64,
    p50: Duration,
    p99: Duration,
}

/// `count` deliveries of which `share` percent repeat an earlier message.
fn deliveries(count: usize, share: u32, seed: u64) -> Vec<Transfer> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out: Vec<Transfer> = Vec::with_capacity(count);
    for i in 0..count {
        if i > 0 && rng.random_range(0..100) < share {
            let earlier = out[rng.random_range(0..i)].clone();
            out.push(earlier);
        } else {
            out.push(Transfer {
                // A version 4 UUID: random bytes with the version set, never mistaken for a UUIDv7.
                message_id: uuid::Builder::from_random_bytes(rng.random()).into_uuid(),
                account: rng.random_range(1..=ACCOUNTS),
            });
        }
    }
    out
}

/// Runs `deliveries` through `handle(worker, delivery)` on `workers` tasks; returns throughput and
/// latencies.
async fn drive<F, Fut>(
    deliveries: Arc<Vec<Transfer>>,
    workers: usize,
    handle: F,
) -> (f64, Vec<Duration>)
where
    F: Fn(usize, Transfer) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..workers)
        .map(|worker| {
            let (next, deliveries, handle) = (next.clone(), deliveries.clone(), handle.clone());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(msg) = deliveries.get(i) else { break };
                    let t = Instant::now();
                    handle(worker, msg.clone()).await;
                    latencies.push(t.elapsed());
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for task in tasks {
        latencies.extend(task.await.expect("a worker panicked"));
    }
    let elapsed = started.elapsed();
    latencies.sort_unstable();
    (deliveries.len() as f64 / elapsed.as_secs_f64(), latencies)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p) as usize]
}

/// Empties the inbox; on PostgreSQL also vacuums and checkpoints, so that every measurement
/// starts from the same state rather than inherit the previous one's dead rows and dirty pages.
async fn reset<DB: idempotent::Backend>(pool: &sqlx::Pool<DB>)
where
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
{
    sqlx::raw_sql("DELETE FROM idempotent_inbox")
        .execute(pool)
        .await
        .unwrap();
    if <DB as sqlx::Database>::NAME == "PostgreSQL" {
        for statement in ["VACUUM idempotent_inbox, accounts", "CHECKPOINT"] {
            sqlx::raw_sql(statement).execute(pool).await.unwrap();
        }
    }
}

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    if let Some(url) = arg("--instance") {
        return instance(&url).await;
    }
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs a benchmark without it, and
    // then it measures nothing.
    if !std::env::args().any(|arg| arg == "--bench") {
        return Ok(());
    }
    let count: usize = arg("--messages").map_or(Ok(3000), |v| v.parse())?;
    let pg_url = std::env::var("IDEMPOTENT_PG_URL")
        .or_else(|_| std::env::var("DATABASE_URL"))
        .expect("IDEMPOTENT_PG_URL: a PostgreSQL to measure on");
    if let Some(rows) = arg("--bloat") {
        return bloat(&fresh_postgres(&pg_url).await, rows.parse()?, count).await;
    }
    let mut results = Vec::new();

    // PostgreSQL.
    let pg_db = fresh_postgres(&pg_url).await;
    measure!(
        results,
        "PostgreSQL",
        on_postgres,
        count,
        "BIGINT",
        |workers: usize| {
            sqlx::postgres::PgPoolOptions::new()
                .max_connections(workers as u32)
                .connect(&pg_db)
        }
    );

    // SQLite, a file in WAL mode; half the deliveries, as it is slower.
    let dir = tempfile::tempdir()?;
    let sqlite_url = format!("sqlite://{}", dir.path().join("bench.db").display());
    let options = idempotent::sqlite::connect_options(&sqlite_url)?;
    measure!(
        results,
        "SQLite",
        on_sqlite,
        count / 2,
        "INTEGER",
        |workers: usize| {
            sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(workers as u32)
                .connect_with(options.clone())
        }
    );

    print_table(&results);
    // The plot comes last, and a failure to write it only warns: the figures are printed by then.
    let extras = extras(&pg_db, count).await;
    let plot = target_dir().join("bench.svg");
    match write_plot(&plot, &results) {
        Ok(()) => println!("\nplot: {}", plot.display()),
        Err(e) => eprintln!(
            "\nwarning: the plot was not written to {}: {e}",
            plot.display()
        ),
    }
    extras
}

/// Cargo's target directory: `CARGO_TARGET_DIR` when set, else `target/` in the workspace, whose
/// root is this package's folder.
fn target_dir() -> std::path::PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(
        || std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target"),
        Into::into,
    )
}

async fn setup<DB: idempotent::Backend>(pool: &sqlx::Pool<DB>, int: &str)
where
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
{
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS accounts (id {int} PRIMARY KEY, balance {int} NOT NULL);
         DELETE FROM accounts;
         WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n WHERE x < {ACCOUNTS})
         INSERT INTO accounts (id, balance) SELECT x, 0 FROM n;"
    )))
    .execute(pool)
    .await
    .unwrap();
}

async fn fresh_postgres(base: &str) -> String {
    use sqlx::Connection;
    let name = format!("bench_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(base).await.expect("PostgreSQL");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .unwrap();
    let (prefix, _) = base.rsplit_once('/').expect("a database in the URL");
    format!("{prefix}/{name}")
}

fn print_table(results: &[Measured]) {
    println!(
        "\n{:<11} {:>5} {:>7} {:>5}  {:>20} {:>20} {:>20}  {:>7} {:>7}",
        "backend",
        "conn.",
        "workers",
        "dup%",
        "(a) no inbox",
        "(b) #[idempotent]",
        "(c) check-then-ins.",
        "b/a",
        "b/c"
    );
    println!(
        "{:<11} {:>5} {:>7} {:>5}  {:>20} {:>20} {:>20}",
        "", "", "", "", "msg/s p50 p99 ms", "msg/s p50 p99 ms", "msg/s p50 p99 ms"
    );
    for row in results.chunks(3) {
        let cell = |m: &Measured| {
            format!(
                "{:>6.0} {:>5.2} {:>5.2}",
                m.per_second,
                m.p50.as_secs_f64() * 1e3,
                m.p99.as_secs_f64() * 1e3
            )
        };
        let (a, b, c) = (&row[0], &row[1], &row[2]);
        println!(
            "{:<11} {:>5} {:>7} {:>5}  {:>20} {:>20} {:>20}  {:>7.2} {:>7.2}",
            a.backend,
            if a.held { "held" } else { "pool" },
            a.workers,
            a.duplicates,
            cell(a),
            cell(b),
            cell(c),
            b.per_second / a.per_second,
            b.per_second / c.per_second
        );
    }
}

/// Throughput of each variant by workers, one panel per backend, connection use and duplicate
/// share, as SVG.
fn write_plot(
    path: &std::path::Path,
    results: &[Measured],
) -> Result<(), Box<dyn std::error::Error>> {
    use plotters::prelude::*;
    if let Some(folder) = path.parent() {
        std::fs::create_dir_all(folder)?;
    }
    let root = SVGBackend::new(path, (1600, 700)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((2, 4));
    let keys = ["PostgreSQL", "SQLite"].into_iter().flat_map(|backend| {
        [(false, 0), (false, 20), (true, 0), (true, 20)].map(|(held, share)| (backend, held, share))
    });
    for (panel, (backend, held, share)) in panels.iter().zip(keys) {
        let rows: Vec<&Measured> = results
            .iter()
            .filter(|m| m.backend == backend && m.held == held && m.duplicates == share)
            .collect();
        let top = rows.iter().map(|m| m.per_second).fold(0.0, f64::max) * 1.15;
        let mut chart = ChartBuilder::on(panel)
            .caption(
                format!(
                    "{backend}, {}, {share}% dup.",
                    if held { "held connections" } else { "pool" }
                ),
                ("sans-serif", 16),
            )
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(0f64..17f64, 0f64..top)?;
        chart
            .configure_mesh()
            .x_desc("workers")
            .y_desc("messages/s")
            .draw()?;
        for (variant, color, name) in [
            (Variant::Plain, BLUE, "(a) no inbox"),
            (Variant::Inbox, RED, "(b) #[idempotent]"),
            (Variant::CheckThenInsert, GREEN, "(c) check-then-insert"),
        ] {
            let points: Vec<(f64, f64)> = rows
                .iter()
                .filter(|m| m.variant == variant)
                .map(|m| (m.workers as f64, m.per_second))
                .collect();
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
                .label(name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], color));
            chart.draw_series(
                points
                    .into_iter()
                    .map(|p| Circle::new(p, 3, color.filled())),
            )?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// Batches, pgbench as the physical limit, several instances, a large inbox, a purge during the
/// run; all on PostgreSQL with 8 workers.
async fn extras(url: &str, count: usize) -> Result<(), Box<dyn std::error::Error>> {
    const WORKERS: usize = 8;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(WORKERS as u32)
        .connect(url)
        .await?;
    let inbox = Inbox::new(pool.clone());
    let run = |inbox: Inbox<sqlx::Postgres>, seed: u64| {
        let batch = Arc::new(deliveries(count, 0, seed));
        async move { run_variant!(on_postgres, inbox, Variant::Inbox, false, WORKERS, batch) }
    };
    println!("\nPostgreSQL, {WORKERS} workers, no duplicates:");
    reset(&pool).await;
    let (single, _) = run(inbox.clone(), 11).await;
    println!("  (b) one message per transaction   {single:>8.0} msg/s");

    // The claim sent in one message with its `BEGIN`: one round trip less.
    reset(&pool).await;
    let (pipelined, _) = run(inbox.clone().with_pipelined_claim(), 11).await;
    println!(
        "  (b) with_pipelined_claim()         {pipelined:>8.0} msg/s   ({:.2} of the default claim)",
        pipelined / single
    );

    // Batches of 100: one claim statement, one commit.
    reset(&pool).await;
    let messages = Arc::new(deliveries(count * 10, 0, 12));
    // Each batch updates its accounts in id order, so that two batches wait for each other's row
    // locks instead of deadlocking: the user's side of what the inbox does for its keys.
    let chunks: Arc<Vec<Vec<Transfer>>> = Arc::new(
        messages
            .chunks(100)
            .map(|chunk| {
                let mut chunk = chunk.to_vec();
                chunk.sort_by_key(|m| m.account);
                chunk
            })
            .collect(),
    );
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (next, chunks, inbox) = (next.clone(), chunks.clone(), inbox.clone());
            tokio::spawn(async move {
                while let Some(chunk) = chunks.get(next.fetch_add(1, Ordering::Relaxed)) {
                    // The bodies of two batches update accounts in different orders and may
                    // deadlock; the batch rolls back whole, and is delivered again.
                    loop {
                        let handled = inbox
                            .handle_batch(
                                "bench-batch",
                                chunk,
                                |m| &m.message_id,
                                async |tx: &mut sqlx::PgConnection, m: &Transfer| {
                                    sqlx::query(
                                        "UPDATE accounts SET balance = balance + 1 WHERE id = $1",
                                    )
                                    .bind(m.account)
                                    .execute(&mut *tx)
                                    .await
                                    .map(drop)
                                },
                            )
                            .await;
                        match handled {
                            Ok(_) => break,
                            Err(e)
                                if e.is_retryable()
                                    || e.handler_error().is_some_and(idempotent::is_retryable) => {}
                            Err(e) => panic!("{e:?}"),
                        }
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await?;
    }
    let batched = messages.len() as f64 / started.elapsed().as_secs_f64();
    println!(
        "  batches of 100                     {batched:>8.0} msg/s   ({:.1}x one per transaction)",
        batched / single
    );

    // pgbench running the statements (b) sends, and those (a) sends: the database's limit for
    // each. (b) sends its `BEGIN` and the mark in one simple query, then prepared statements,
    // which a pgbench script cannot mix; the limit is the better of everything as simple queries
    // (the `BEGIN` joined to the mark) and everything prepared (one message more). Against it,
    // (a) and (b) from the pool and with held connections: the median of three runs of three
    // times the deliveries, interleaved.
    let b_limit = [(CLAIM_SQL, "simple"), (SEPARATE_CLAIM_SQL, "prepared")]
        .into_iter()
        .filter_map(|(begin, mode)| pgbench(url, WORKERS, begin, COMMIT_CHECK_SQL, mode))
        .fold(f64::NAN, f64::max);
    let a_limit = pgbench(url, WORKERS, "BEGIN;\n", "", "prepared").unwrap_or(f64::NAN);
    let configurations = [
        (Variant::Plain, false),
        (Variant::Plain, true),
        (Variant::Inbox, false),
        (Variant::Inbox, true),
    ];
    let mut runs: [Vec<f64>; 4] = Default::default();
    for round in 0..3 {
        let batch = Arc::new(deliveries(count * 3, 0, 30 + round));
        for ((variant, held), runs) in configurations.iter().zip(&mut runs) {
            reset(&pool).await;
            let (per_second, _) =
                run_variant!(on_postgres, inbox, *variant, *held, WORKERS, batch.clone());
            runs.push(per_second);
        }
    }
    let [a_pool, a_held, b_pool, b_held] = runs.map(|mut runs| {
        runs.sort_by(f64::total_cmp);
        runs[1]
    });
    println!(
        "  pgbench, the SQL (b) sends         {b_limit:>8.0} tx/s    (b) reaches {:.2} of it from the pool ({b_pool:.0} msg/s), {:.2} with for_worker() ({b_held:.0})",
        b_pool / b_limit,
        b_held / b_limit
    );
    println!(
        "  pgbench, the SQL (a) sends         {a_limit:>8.0} tx/s    (a) reaches {:.2} of it from the pool ({a_pool:.0} msg/s), {:.2} holding a connection ({a_held:.0})",
        a_pool / a_limit,
        a_held / a_limit
    );
    println!(
        "  the database's own (b)/(a)             {:.2}          (b)/(a) {:.2} from the pool, {:.2} holding connections",
        b_limit / a_limit,
        b_pool / a_pool,
        b_held / a_held
    );

    // Instances that share one database, as users grow past one machine: 4 processes with 2
    // workers each against 1 process with 8 (the figure above), the same messages in all.
    reset(&pool).await;
    let started = Instant::now();
    let children: Vec<_> = (0..4)
        .map(|i| {
            tokio::process::Command::new(std::env::current_exe().unwrap())
                .args(["--instance", url, "--seed", &(20 + i).to_string()])
                .args(["--messages", &(count / 4).to_string()])
                .status()
        })
        .collect();
    for child in children {
        assert!(child.await?.success(), "an instance failed");
    }
    let instances = (count / 4 * 4) as f64 / started.elapsed().as_secs_f64();
    println!(
        "  4 processes x 2 workers            {instances:>8.0} msg/s   ({:.2} of 1 process x 8 workers, process start included)",
        instances / single
    );

    // A large inbox.
    let big: i64 = arg("--big-inbox").map_or(Ok(1_000_000), |v| v.parse())?;
    reset(&pool).await;
    sqlx::query(
        "INSERT INTO idempotent_inbox (consumer, message_key)
         SELECT 'other', int8send(g) FROM generate_series(1, $1) g",
    )
    .bind(big)
    .execute(&pool)
    .await?;
    sqlx::raw_sql("VACUUM ANALYZE idempotent_inbox")
        .execute(&pool)
        .await?;
    let (large, _) = run(inbox.clone(), 13).await;
    println!(
        "  (b) with {big} rows in the inbox {large:>8.0} msg/s   ({:.2} of an empty inbox)",
        large / single
    );

    // A purge of expired rows while (b) runs, on its own pool of 2 connections (one holds the
    // purger's lock): back to back with `purge_expired`, and paced by the background purger.
    let expired: i64 = arg("--purge").map_or(Ok(200_000), |v| v.parse())?;
    let purging = Inbox::new(
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(url)
            .await?,
    );
    let fill = || {
        let pool = pool.clone();
        async move {
            reset(&pool).await;
            sqlx::query(
                "INSERT INTO idempotent_inbox (consumer, message_key, processed_at)
                 SELECT 'old', int8send(g), now() - interval '30 days'
                 FROM generate_series(1, $1) g",
            )
            .bind(expired)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    fill().await;
    let purge_started = Instant::now();
    let (purged, (during, latencies)) = tokio::join!(
        async {
            let report = purging.purge_expired(1000).await.unwrap();
            (report, purge_started.elapsed())
        },
        run(inbox.clone(), 14)
    );
    println!(
        "  (b) while purge_expired(1000) deletes {} rows {during:>8.0} msg/s   ({:.2} of no purge), worst claim {:.1} ms; the purge took {:.1} s in {} batches",
        purged.0.deleted,
        during / single,
        latencies.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
        purged.1.as_secs_f64(),
        purged.0.batches
    );
    fill().await;
    let before = purging.metrics().rows_purged;
    let purger = purging.spawn_purger(idempotent::PurgerOptions::every(Duration::from_secs(3600)));
    let (paced, latencies) = run(inbox.clone(), 15).await;
    purger.stop();
    println!(
        "  (b) while the background purger runs {paced:>8.0} msg/s   ({:.2} of no purge), worst claim {:.1} ms; it deleted {} rows meanwhile (batches of 1000, 10 ms apart)",
        paced / single,
        latencies.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
        purging.metrics().rows_purged - before
    );
    Ok(())
}

/// What a purge leaves behind: an inbox of `rows` rows, consumers at 8 workers while the
/// background purger removes a fifth of it, three times (`--cycles`; each time a fifth of the inbox expired
/// first, as time passing would), against the same consumers without a purge; the table's and its
/// indexes' sizes, dead and free space after each cycle, with autovacuum as configured.
async fn bloat(url: &str, rows: i64, count: usize) -> Result<(), Box<dyn std::error::Error>> {
    const WORKERS: usize = 8;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(WORKERS as u32 + 1)
        .connect(url)
        .await?;
    setup(&pool, "BIGINT").await;
    let inbox = Inbox::new(pool.clone());
    inbox.migrate().await?;
    sqlx::raw_sql("CREATE EXTENSION IF NOT EXISTS pgstattuple")
        .execute(&pool)
        .await?;
    let purging = Inbox::new(
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(url)
            .await?,
    );
    let expire = rows / 5;
    // Keys numbered from `from`: rows that stay, or (with an old time) rows that expire.
    let insert = |from: i64, n: i64, old: bool| {
        let pool = pool.clone();
        async move {
            let age = if old { "30 days" } else { "0 days" };
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO idempotent_inbox (consumer, message_key, processed_at)
                 SELECT 'other', int8send(g), now() - interval '{age}' FROM generate_series($1, $2) g"
            )))
            .bind(from)
            .bind(from + n - 1)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    let started = Instant::now();
    insert(1, rows, false).await;
    sqlx::raw_sql("VACUUM ANALYZE idempotent_inbox")
        .execute(&pool)
        .await?;
    println!(
        "PostgreSQL, {WORKERS} workers, an inbox of {rows} rows (filled in {:.0} s); a cycle expires {expire} rows and the background purger removes them while the consumers run\n",
        started.elapsed().as_secs_f64()
    );
    println!(
        "{:<28} {:>9} {:>8} {:>9} {:>8} {:>9} {:>9} {:>7} {:>7} {:>8}",
        "",
        "msg/s",
        "x none",
        "p99 ms",
        "x none",
        "total MB",
        "index MB",
        "dead %",
        "free %",
        "leaf %"
    );
    let sizes = |label: String, measured: Option<(f64, f64, f64, f64)>| {
        let pool = pool.clone();
        async move {
            let (total, index): (i64, i64) = sqlx::query_as(
                "SELECT pg_total_relation_size('idempotent_inbox'), pg_indexes_size('idempotent_inbox')",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            let (dead, free): (f64, f64) = sqlx::query_as(
                "SELECT dead_tuple_percent, free_percent FROM pgstattuple('idempotent_inbox')",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            let (leaf,): (f64,) =
                sqlx::query_as("SELECT avg_leaf_density FROM pgstatindex('idempotent_inbox_pkey')")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            let mb = |bytes: i64| bytes as f64 / (1 << 20) as f64;
            let [rate, rate_x, p99, p99_x] = measured.map_or_else(
                || std::array::from_fn(|_| "-".to_owned()),
                |(r, rx, p, px)| {
                    [
                        format!("{r:.0}"),
                        format!("{rx:.2}"),
                        format!("{p:.1}"),
                        format!("{px:.2}"),
                    ]
                },
            );
            println!(
                "{label:<28} {rate:>9} {rate_x:>8} {p99:>9} {p99_x:>8} {:>9.0} {:>9.0} {dead:>7.1} {free:>7.1} {leaf:>8.1}",
                mb(total),
                mb(index)
            );
        }
    };
    let consume = |seed: u64| {
        let inbox = inbox.clone();
        let batch = Arc::new(deliveries(count, 0, seed));
        async move { run_variant!(on_postgres, inbox, Variant::Inbox, false, WORKERS, batch) }
    };
    sizes("filled".into(), None).await;
    let (none, latencies) = consume(40).await;
    let none_p99 = percentile(&latencies, 0.99).as_secs_f64() * 1e3;
    sizes(
        "consumers, no purge".into(),
        Some((none, 1.0, none_p99, 1.0)),
    )
    .await;
    let mut next_key = rows + 1;
    let cycles: u64 = arg("--cycles").map_or(Ok(3), |v| v.parse())?;
    for cycle in 1..=cycles {
        insert(next_key, expire, true).await;
        next_key += expire;
        let before = purging.metrics().rows_purged;
        let purger =
            purging.spawn_purger(idempotent::PurgerOptions::every(Duration::from_secs(3600)));
        // The consumers run until the purge is done.
        let (mut handled, mut took, mut latencies) = (0usize, 0.0, Vec::new());
        let mut seed = 40 + cycle * 100;
        loop {
            let started = Instant::now();
            let (_, mut measured) = consume(seed).await;
            took += started.elapsed().as_secs_f64();
            handled += count;
            latencies.append(&mut measured);
            seed += 1;
            if purging.metrics().rows_purged - before >= expire as u64 {
                break;
            }
        }
        purger.stop();
        latencies.sort_unstable();
        let rate = handled as f64 / took;
        let p99 = percentile(&latencies, 0.99).as_secs_f64() * 1e3;
        sizes(
            format!("cycle {cycle}: purge while consuming"),
            Some((rate, rate / none, p99, p99 / none_p99)),
        )
        .await;
    }
    // What VACUUM alone (not FULL) gives back, after the cycles.
    sqlx::raw_sql("VACUUM idempotent_inbox")
        .execute(&pool)
        .await?;
    sizes("after VACUUM".into(), None).await;
    Ok(())
}

/// One instance of a service: (b) with 2 workers over its own messages.
async fn instance(url: &str) -> Result<(), Box<dyn std::error::Error>> {
    let seed: u64 = arg("--seed").map_or(Ok(1), |v| v.parse())?;
    let count: usize = arg("--messages").map_or(Ok(750), |v| v.parse())?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(url)
        .await?;
    let inbox = Inbox::new(pool);
    let batch = Arc::new(deliveries(count, 0, seed));
    run_variant!(on_postgres, inbox, Variant::Inbox, false, 2, batch);
    Ok(())
}

/// What (b) sends before its `UPDATE` with the default (quiet) claim: the `BEGIN` with the mark
/// its commit checks, in one message (`\;` joins them in a pgbench script, sent as a simple
/// query), then the claim.
const CLAIM_SQL: &str = "BEGIN \\; SET LOCAL idempotent.claim = 'on';\n\
    INSERT INTO idempotent_inbox (consumer, message_key, fingerprint) \
    VALUES ('pgbench', decode(md5(random()::text || clock_timestamp()::text), 'hex'), NULL) \
    ON CONFLICT DO NOTHING;\n";

/// The same as statements of their own (a prepared script cannot join two).
const SEPARATE_CLAIM_SQL: &str = "BEGIN;\n\
    SET LOCAL idempotent.claim = 'on';\n\
    INSERT INTO idempotent_inbox (consumer, message_key, fingerprint) \
    VALUES ('pgbench', decode(md5(random()::text || clock_timestamp()::text), 'hex'), NULL) \
    ON CONFLICT DO NOTHING;\n";

/// What (b) sends after its `UPDATE`, before `COMMIT`: the check that the transaction is still the
/// one the inbox began.
const COMMIT_CHECK_SQL: &str = "SELECT current_setting('idempotent.claim', true);\n";

/// Runs pgbench for 5 seconds in query `mode` with one delivery's statements: `begin` (a plain
/// `BEGIN`, or with the claim), the `UPDATE`, `before_commit`, `COMMIT`; its tx/s.
fn pgbench(url: &str, clients: usize, begin: &str, before_commit: &str, mode: &str) -> Option<f64> {
    let script = std::env::temp_dir().join("idempotent-bench.sql");
    std::fs::write(
        &script,
        format!(
            "\\set id random(1, 10000)\n{begin}\
             UPDATE accounts SET balance = balance + 1 WHERE id = :id;\n\
             {before_commit}COMMIT;\n"
        ),
    )
    .ok()?;
    let output = std::process::Command::new("pgbench")
        .args(["-n", "-M", mode, "-T", "5", "-j", "2"])
        .arg("-c")
        .arg(clients.to_string())
        .arg("-f")
        .arg(&script)
        .arg(url)
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines()
        .find(|l| l.starts_with("tps = "))
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|v| v.parse().ok())
}
