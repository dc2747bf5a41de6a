//! What the HTTP layer costs: requests per second of one route, over real HTTP on loopback, on
//! PostgreSQL, in one process (server and client), as
//!
//! - (a) the route without the layer: `BEGIN`, insert the payment, `COMMIT` (fast, and wrong
//!   under retries: a retry pays twice);
//! - (b) the same route behind `IdempotencyLayer::transactional`, its insert on the claimed
//!   transaction;
//! - (c) the same route doing its own check-then-insert, as the background article's handler does:
//!   `BEGIN`, `SELECT` the key's stored response body (a retry gets it), insert the payment, insert
//!   the key with the response body (a unique violation: `409`), `COMMIT`. Simpler than (b): no
//!   fingerprint, no status or headers stored, and a concurrent twin waits on the first one's
//!   uncommitted key instead of getting a `409` at once.
//!
//! Each cell sends `--requests` requests (2000) to each route from `--concurrency` client tasks
//! (1, 8 and 32), each with a fresh `Idempotency-Key`, or (with 20% retries) 1 in 5 a retry of one
//! of its earlier requests. The routes take turns in `--rounds` rounds (3); a route's rate is its
//! median round, its latencies those of all its rounds. `--routes` names the routes to run
//! (`plain`, `layered`, `checked`: all three by default), to profile one alone, for example
//! under `perf stat`; the others' columns print `–`.
//!
//! ```text
//! IDEMPOTENT_PG_URL=postgres://postgres@127.0.0.1:25432/postgres \
//!   cargo bench --bench http --features http,postgres
//! ```

use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idempotent::http::{IdempotencyLayer, IdempotentTx, RequestKey};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{ConnectOptions, Connection};

#[derive(Deserialize)]
struct Payment {
    amount_cents: i64,
}

fn created(id: i64) -> Response {
    created_body(format!("{{\"id\":{id}}}").into_bytes())
}

fn created_body(body: Vec<u8>) -> Response {
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        body,
    )
        .into_response()
}

const INSERT_PAYMENT: &str =
    "INSERT INTO payments (client, amount_cents) VALUES ($1, $2) RETURNING id";

fn client_of(headers: &HeaderMap) -> String {
    headers
        .get("x-client")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("anonymous")
        .to_owned()
}

/// (a) No layer.
async fn plain(
    State(pool): State<PgPool>,
    headers: HeaderMap,
    axum::Json(payment): axum::Json<Payment>,
) -> Response {
    let mut tx = pool.begin().await.unwrap();
    let id: i64 = sqlx::query_scalar(INSERT_PAYMENT)
        .bind(client_of(&headers))
        .bind(payment.amount_cents)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    created(id)
}

/// (b) Behind the layer.
async fn layered(
    key: RequestKey,
    mut tx: IdempotentTx<sqlx::Postgres>,
    axum::Json(payment): axum::Json<Payment>,
) -> Response {
    let id: i64 = sqlx::query_scalar(INSERT_PAYMENT)
        .bind(key.scope())
        .bind(payment.amount_cents)
        .fetch_one(tx.connection())
        .await
        .unwrap();
    created(id)
}

/// (c) Its own check-then-insert.
async fn checked(
    State(pool): State<PgPool>,
    headers: HeaderMap,
    axum::Json(payment): axum::Json<Payment>,
) -> Response {
    let client = client_of(&headers);
    let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let mut tx = pool.begin().await.unwrap();
    let stored: Option<Vec<u8>> =
        sqlx::query_scalar("SELECT response FROM own_keys WHERE client = $1 AND key = $2")
            .bind(&client)
            .bind(key)
            .fetch_optional(&mut *tx)
            .await
            .unwrap();
    if let Some(response) = stored {
        tx.rollback().await.unwrap();
        return created_body(response);
    }
    let id: i64 = sqlx::query_scalar(INSERT_PAYMENT)
        .bind(&client)
        .bind(payment.amount_cents)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let response = format!("{{\"id\":{id}}}").into_bytes();
    let recorded = sqlx::query("INSERT INTO own_keys (client, key, response) VALUES ($1, $2, $3)")
        .bind(&client)
        .bind(key)
        .bind(&response)
        .execute(&mut *tx)
        .await;
    match recorded {
        Ok(_) => {
            tx.commit().await.unwrap();
            created_body(response)
        }
        Err(error)
            if error
                .as_database_error()
                .is_some_and(|e| e.is_unique_violation()) =>
        {
            StatusCode::CONFLICT.into_response()
        }
        Err(error) => panic!("{error}"),
    }
}

/// The routes, in the table's order: (a), (b), (c).
const ROUTES: [&str; 3] = ["plain", "layered", "checked"];

/// What one round of one route measured.
struct Round {
    per_second: f64,
    latencies: Vec<Duration>,
    retries: usize,
}

/// What the rounds of one route measured: the median rate, the latencies of all of them.
struct Cell {
    per_second: f64,
    p50: Duration,
    p99: Duration,
    retries: usize,
}

impl Cell {
    fn of(mut rounds: Vec<Round>) -> Self {
        rounds.sort_by(|a, b| a.per_second.total_cmp(&b.per_second));
        let per_second = rounds[rounds.len() / 2].per_second;
        let retries = rounds.iter().map(|r| r.retries).sum();
        let mut latencies: Vec<Duration> = rounds.into_iter().flat_map(|r| r.latencies).collect();
        latencies.sort();
        let at =
            |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
        Cell {
            per_second,
            p50: at(0.50),
            p99: at(0.99),
            retries,
        }
    }
}

/// Sends `requests` requests to `url` from `concurrency` tasks, `retry_percent` of them retries.
async fn load(url: &str, requests: usize, concurrency: usize, retry_percent: u32) -> Round {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()
        .unwrap();
    let run = uuid::Uuid::new_v4().simple().to_string();
    let started = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|worker| {
            let (http, url, run) = (http.clone(), url.to_owned(), run.clone());
            let share = requests / concurrency + usize::from(worker < requests % concurrency);
            tokio::spawn(async move {
                let mut rng = StdRng::seed_from_u64(worker as u64);
                let mut sent: Vec<String> = Vec::new();
                let mut latencies = Vec::with_capacity(share);
                let mut retries = 0;
                for n in 0..share {
                    let key = if !sent.is_empty() && rng.random_range(0..100) < retry_percent {
                        retries += 1;
                        sent[rng.random_range(0..sent.len())].clone()
                    } else {
                        let key = format!("{run}-{worker}-{n}");
                        sent.push(key.clone());
                        key
                    };
                    let begun = Instant::now();
                    let response = http
                        .post(&url)
                        .header("x-client", format!("client-{worker}"))
                        .header("idempotency-key", &key)
                        .header("content-type", "application/json")
                        .body("{\"amount_cents\":1250}")
                        .send()
                        .await
                        .unwrap();
                    let status = response.status();
                    let _ = response.bytes().await.unwrap();
                    assert!(status.is_success(), "{url}: {status}");
                    latencies.push(begun.elapsed());
                }
                (latencies, retries)
            })
        })
        .collect();
    let mut latencies = Vec::with_capacity(requests);
    let mut retries = 0;
    for worker in workers {
        let (worker_latencies, worker_retries) = worker.await.unwrap();
        latencies.extend(worker_latencies);
        retries += worker_retries;
    }
    Round {
        per_second: requests as f64 / started.elapsed().as_secs_f64(),
        latencies,
        retries,
    }
}

fn arg(name: &str) -> Option<String> {
    let mut args = std::env::args().skip_while(|a| a != name);
    args.next()?;
    args.next()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // `cargo bench` passes `--bench`; `cargo test --all-targets` runs a benchmark without it, and
    // then it measures nothing.
    if !std::env::args().any(|arg| arg == "--bench") {
        return Ok(());
    }
    let url = std::env::var("IDEMPOTENT_PG_URL")
        .or_else(|_| std::env::var("DATABASE_URL"))
        .map_err(|_| "set IDEMPOTENT_PG_URL (or DATABASE_URL) to a PostgreSQL database")?;
    let requests: usize = arg("--requests").map_or(Ok(2000), |n| n.parse())?;
    let concurrencies: Vec<usize> = arg("--concurrency")
        .unwrap_or_else(|| "1,8,32".into())
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    let connections: u32 = arg("--connections").map_or(Ok(16), |n| n.parse())?;
    let rounds: usize = arg("--rounds").map_or(Ok(3), |n| n.parse())?;
    let routes: Vec<&str> = match arg("--routes") {
        None => ROUTES.to_vec(),
        Some(names) => names
            .split(',')
            .map(|name| {
                ROUTES
                    .into_iter()
                    .find(|route| *route == name)
                    .ok_or_else(|| format!("--routes: {name:?} is none of {ROUTES:?}"))
            })
            .collect::<Result<_, _>>()?,
    };

    // A schema of its own, dropped at the end.
    let schema = format!("bench_http_{}", uuid::Uuid::new_v4().simple());
    let options: PgConnectOptions = url.parse()?;
    let mut admin = options.connect().await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&mut admin)
        .await?;
    let options = options.options([("search_path", schema.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .connect_with(options)
        .await?;
    for statement in [
        "CREATE TABLE payments (id BIGSERIAL PRIMARY KEY, client TEXT NOT NULL, amount_cents BIGINT NOT NULL)",
        "CREATE TABLE own_keys (client TEXT NOT NULL, key TEXT NOT NULL, response BYTEA NOT NULL,
                                created_at TIMESTAMPTZ NOT NULL DEFAULT now(), PRIMARY KEY (client, key))",
    ] {
        sqlx::query(statement).execute(&pool).await?;
    }
    let inbox = idempotent::Inbox::new(pool.clone());
    inbox.migrate().await?;
    let layer = IdempotencyLayer::transactional(inbox, |parts| {
        parts
            .headers
            .get("x-client")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    });
    let router = Router::new()
        .route("/plain", post(plain))
        .route("/layered", post(layered).layer(layer))
        .route("/checked", post(checked))
        .with_state(pool.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, router).await });

    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "{requests} requests per route and cell, in {rounds} rounds; pool of {connections} connections; {cores} cores; server and client in one process\n"
    );
    println!(
        "| clients | retries | (a) no layer req/s | (b) layer req/s | (c) check-then-insert req/s | (a) p50 / p99 ms | (b) p50 / p99 ms | (c) p50 / p99 ms | **b/a** | **b/c** |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let started = Instant::now();
    for &concurrency in &concurrencies {
        for retry_percent in [0, 20] {
            // The routes take turns, round after round, so that a change in the machine's load
            // falls on all of them alike; each one's rate is its median round.
            let mut measured: Vec<Vec<Round>> = routes.iter().map(|_| Vec::new()).collect();
            for route in &routes {
                load(
                    &format!("{base}/{route}"),
                    requests / 10,
                    concurrency,
                    retry_percent,
                )
                .await;
            }
            for _ in 0..rounds {
                for (route, measured) in routes.iter().zip(&mut measured) {
                    let url = format!("{base}/{route}");
                    measured.push(load(&url, requests / rounds, concurrency, retry_percent).await);
                }
            }
            let mut cells: Vec<(&str, Cell)> = routes
                .iter()
                .copied()
                .zip(measured.into_iter().map(Cell::of))
                .collect();
            let [a, b, c] = ROUTES.map(|route| {
                let at = cells.iter().position(|(name, _)| *name == route)?;
                Some(cells.remove(at).1)
            });
            let rate = |cell: &Option<Cell>| {
                cell.as_ref()
                    .map_or("–".into(), |cell| format!("{:.0}", cell.per_second))
            };
            let latency = |cell: &Option<Cell>| {
                cell.as_ref().map_or("–".into(), |cell| {
                    format!("{:.2} / {:.2}", ms(cell.p50), ms(cell.p99))
                })
            };
            let ratio = |x: &Option<Cell>, y: &Option<Cell>| match (x, y) {
                (Some(x), Some(y)) => format!("{:.2}", x.per_second / y.per_second),
                _ => "–".into(),
            };
            let retries = [&b, &a, &c]
                .into_iter()
                .flatten()
                .next()
                .map_or(0, |cell| cell.retries);
            println!(
                "| {concurrency} | {retry_percent}% ({retries}) | {} | {} | {} | {} | {} | {} | **{}** | **{}** |",
                rate(&a),
                rate(&b),
                rate(&c),
                latency(&a),
                latency(&b),
                latency(&c),
                ratio(&b, &a),
                ratio(&b, &c),
            );
            for table in ["payments", "own_keys", "idempotent_inbox"] {
                sqlx::query(sqlx::AssertSqlSafe(format!("TRUNCATE {table}")))
                    .execute(&pool)
                    .await?;
            }
        }
    }
    let (paid, keys): (i64, i64) = (
        sqlx::query_scalar("SELECT COUNT(*) FROM payments")
            .fetch_one(&pool)
            .await?,
        sqlx::query_scalar("SELECT COUNT(*) FROM idempotent_inbox")
            .fetch_one(&pool)
            .await?,
    );
    assert_eq!((paid, keys), (0, 0), "truncated after the last cell");
    println!("\ntook {:.0} s", started.elapsed().as_secs_f64());

    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&mut admin)
        .await?;
    admin.close().await?;
    Ok(())
}
