//! Hostile tests of four changes, from the public API, on PostgreSQL (`IDEMPOTENT_PG_URL`) and
//! through PgBouncer in transaction mode (`IDEMPOTENT_PGBOUNCER_URL`):
//!
//! 1. the HTTP layer's claim, whose advisory lock rides in the `BEGIN`'s message and whose one
//!    statement reads the committed row and a leased call of the key;
//! 2. the outgoing rows' `RETURNING` proof of the inbox's transaction;
//! 3. `TransactionEnded` when outgoing rows cannot be written after the body ended the
//!    transaction;
//! 4. the pipelined claim's rule for forgetting sqlx's statements.
#![cfg(all(feature = "http", feature = "postgres"))]

#[path = "../support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::response::Response;
use axum::routing::post;
use idempotent::http::{IdempotencyLayer, IdempotentTx, REPLAYED};
use idempotent::outbox::{Destination, OutgoingMessage};
use idempotent::{Inbox, InboxError, Tenants};
use serde::Deserialize;
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Postgres};
use support::postgres::{PgHarness, pgbouncer_urls};

/// What the handler does, sent as the request's body.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
struct Order {
    label: String,
    /// Sent (raw, unprepared) before the effect.
    before: Vec<String>,
    /// Sent (raw, unprepared) after the effect.
    after: Vec<String>,
    /// Outgoing messages queued before `before` runs.
    outgoing: usize,
    /// Sleeps this long before it answers.
    sleep_ms: u64,
}

#[derive(Default)]
struct Seen {
    runs: Mutex<HashMap<String, u64>>,
}

impl Seen {
    fn run(&self, label: &str) -> u64 {
        let mut runs = self.runs.lock().unwrap();
        let run = runs.entry(label.to_owned()).or_default();
        *run += 1;
        *run
    }

    fn runs(&self, label: &str) -> u64 {
        self.runs.lock().unwrap().get(label).copied().unwrap_or(0)
    }
}

#[derive(Clone)]
struct App {
    pool: PgPool,
    seen: Arc<Seen>,
}

fn scope(_: &axum::http::request::Parts) -> Option<String> {
    Some("client".to_owned())
}

fn answer(label: &str, run: u64) -> Response {
    Response::builder()
        .status(201)
        .header("content-type", "application/json")
        .body(Body::from(
            json!({ "label": label, "run": run }).to_string(),
        ))
        .unwrap()
}

async fn pay(
    State(app): State<App>,
    mut tx: IdempotentTx<Postgres>,
    axum::Json(order): axum::Json<Order>,
) -> Response {
    let run = app.seen.run(&order.label);
    for n in 0..order.outgoing {
        let mut message = OutgoingMessage::new(
            Destination::queue("q"),
            format!("{}-{n}", order.label).into_bytes(),
        );
        if n % 2 == 1 {
            message = message.with_ordering_key(format!("k{}", n % 3));
        }
        tx.claimed_mut().outbox().send(message);
    }
    for statement in &order.before {
        if let Err(error) = sqlx::raw_sql(AssertSqlSafe(statement.clone()))
            .execute(tx.connection())
            .await
        {
            return Response::builder()
                .status(500)
                .body(Body::from(format!("{statement}: {error}")))
                .unwrap();
        }
    }
    // The simple query protocol: one message, which works behind PgBouncer outside a
    // transaction too (after the body ended it). Labels are the test's own.
    let written = sqlx::raw_sql(AssertSqlSafe(format!(
        "INSERT INTO effects (consumer, label) VALUES ('pay', '{}')",
        order.label
    )))
    .execute(tx.connection())
    .await;
    if let Err(error) = written {
        return Response::builder()
            .status(500)
            .body(Body::from(format!("the effect failed: {error}")))
            .unwrap();
    }
    for statement in &order.after {
        if let Err(error) = sqlx::raw_sql(AssertSqlSafe(statement.clone()))
            .execute(tx.connection())
            .await
        {
            return Response::builder()
                .status(500)
                .body(Body::from(format!("{statement}: {error}")))
                .unwrap();
        }
    }
    tokio::time::sleep(Duration::from_millis(order.sleep_ms)).await;
    answer(&order.label, run)
}

/// Its effect on its own, as an outside service would.
async fn lease(State(app): State<App>, axum::Json(order): axum::Json<Order>) -> Response {
    let run = app.seen.run(&order.label);
    tokio::time::sleep(Duration::from_millis(order.sleep_ms)).await;
    sqlx::query("INSERT INTO effects (consumer, label) VALUES ('lease', $1)")
        .bind(&order.label)
        .execute(&app.pool)
        .await
        .unwrap();
    answer(&order.label, run)
}

/// One instance of the app (its own inbox, so its own in-flight set), served on loopback.
async fn serve(inbox: Inbox<Postgres>, effects: PgPool, seen: Arc<Seen>) -> SocketAddr {
    let payments = IdempotencyLayer::transactional(inbox.clone(), scope);
    let emails = IdempotencyLayer::leased(inbox, scope, Duration::from_secs(30)).unwrap();
    let router = Router::new()
        .route("/pay", post(pay).layer(payments))
        .route("/lease", post(lease).layer(emails))
        .with_state(App {
            pool: effects,
            seen,
        });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    addr
}

#[derive(Debug, Clone)]
struct Reply {
    status: u16,
    replayed: bool,
    body: String,
}

impl Reply {
    fn code(&self) -> String {
        serde_json::from_str::<serde_json::Value>(&self.body)
            .ok()
            .and_then(|v| v["code"].as_str().map(str::to_owned))
            .unwrap_or_default()
    }
}

async fn send(
    client: &reqwest::Client,
    addr: SocketAddr,
    route: &str,
    key: &str,
    order: &serde_json::Value,
    timeout: Option<Duration>,
) -> Result<Reply, reqwest::Error> {
    let mut request = client
        .post(format!("http://{addr}{route}"))
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(order.to_string());
    if let Some(timeout) = timeout {
        request = request.timeout(timeout);
    }
    let response = request.send().await?;
    let status = response.status().as_u16();
    let replayed = response.headers().get(REPLAYED).is_some();
    let body = response.text().await?;
    Ok(Reply {
        status,
        replayed,
        body,
    })
}

/// Sends until the answer is no 409 (at most 20 s).
async fn settle(
    client: &reqwest::Client,
    addr: SocketAddr,
    route: &str,
    key: &str,
    order: &serde_json::Value,
) -> Reply {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let reply = send(client, addr, route, key, order, None).await.unwrap();
        if reply.status != 409 || Instant::now() > deadline {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn effects(pool: &PgPool, label: &str) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM effects WHERE label = $1")
        .bind(label)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn outbox_rows(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM idempotent_inbox_outbox")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Where the layer's inboxes connect: PostgreSQL itself, or PgBouncer in transaction mode.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Via {
    Direct,
    Bouncer,
}

/// A fresh database (a schema, or through PgBouncer a database) with `effects`, and a maker of
/// inboxes with pools of `n` connections to it.
struct Db {
    h: PgHarness,
    via: Via,
}

impl Db {
    async fn new(via: Via) -> Self {
        let h = match via {
            Via::Direct => PgHarness::new().await,
            Via::Bouncer => PgHarness::through_pgbouncer().await,
        };
        Self { h, via }
    }

    fn inbox(&self, connections: u32) -> Inbox<Postgres> {
        match self.via {
            Via::Direct => {
                let options = self.h.pool.connect_options().as_ref().clone();
                let pool = PgPoolOptions::new()
                    .max_connections(connections)
                    .acquire_timeout(Duration::from_secs(30))
                    .connect_lazy_with(options);
                Inbox::new(pool)
            }
            Via::Bouncer => {
                let (bouncer, _) = pgbouncer_urls();
                let options: PgConnectOptions = bouncer.parse().unwrap();
                let options = options.database(&self.h.schema).statement_cache_capacity(0);
                let pool = PgPoolOptions::new()
                    .max_connections(connections)
                    .acquire_timeout(Duration::from_secs(30))
                    .connect_lazy_with(options);
                Inbox::new(pool).with_transaction_pooling()
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Twins of one key, over instances sharing a pool of 1 or 16, and a leased route racing.

async fn twins_of_one_key_run_once(via: Via) {
    let db = Db::new(via).await;
    let client = reqwest::Client::new();
    for connections in [1, 16] {
        let seen = Arc::new(Seen::default());
        // Six instances on one pool: each its own inbox (its own in-flight set), so their twins
        // meet in the database's claim.
        let pool_inbox = db.inbox(connections);
        let mut addrs = Vec::new();
        for _ in 0..6 {
            let inbox = Inbox::new(pool_inbox.pool().clone());
            let inbox = if via == Via::Bouncer {
                inbox.with_transaction_pooling()
            } else {
                inbox
            };
            addrs.push(serve(inbox, db.h.pool.clone(), seen.clone()).await);
        }
        for round in 0..3 {
            // Transactional twins only.
            let label = format!("twins-{connections}-{round}");
            let order = json!({ "label": label, "sleep_ms": 150 });
            let calls = (0..48).map(|i| send(&client, addrs[i % 6], "/pay", &label, &order, None));
            let replies: Vec<Reply> = futures::future::join_all(calls)
                .await
                .into_iter()
                .map(Result::unwrap)
                .collect();
            let ran: Vec<&Reply> = replies
                .iter()
                .filter(|r| r.status == 201 && !r.replayed)
                .collect();
            assert_eq!(ran.len(), 1, "{label}: {replies:#?}");
            for reply in &replies {
                match reply.status {
                    201 => assert_eq!(reply.body, ran[0].body, "{label}: {reply:?}"),
                    409 => assert_eq!(reply.code(), "idempotency_key_in_use", "{label}"),
                    _ => panic!("{label}: {reply:?}"),
                }
            }
            let retry = settle(&client, addrs[round], "/pay", &label, &order).await;
            assert_eq!((retry.status, retry.replayed), (201, true), "{retry:?}");
            assert_eq!(retry.body, ran[0].body);
            assert_eq!(seen.runs(&label), 1, "{label}");
            assert_eq!(effects(&db.h.pool, &label).await, 1, "{label}");

            // A transactional and a leased route on the same consumer, twins of one key.
            let label = format!("mixed-{connections}-{round}");
            let order = json!({ "label": label, "sleep_ms": 150 });
            let calls = (0..24).map(|i| {
                let route = if i % 2 == 0 { "/pay" } else { "/lease" };
                let order = order.clone();
                let client = &client;
                let addr = addrs[i % 6];
                let label = &label;
                async move {
                    (
                        route,
                        send(client, addr, route, label, &order, None)
                            .await
                            .unwrap(),
                    )
                }
            });
            let replies: Vec<(&str, Reply)> = futures::future::join_all(calls).await;
            let ran: Vec<&(&str, Reply)> = replies
                .iter()
                .filter(|(_, r)| r.status == 201 && !r.replayed)
                .collect();
            assert_eq!(ran.len(), 1, "{label}: {replies:#?}");
            let (winner, won) = ran[0];
            for (route, reply) in &replies {
                match reply.status {
                    201 => {
                        assert_eq!(route, winner, "{label}: {reply:?}");
                        assert_eq!(reply.body, won.body, "{label}: {reply:?}");
                    }
                    409 => assert_eq!(reply.code(), "idempotency_key_in_use", "{label}"),
                    // The other route's request, once the winner's response is stored.
                    422 => assert_ne!(route, winner, "{label}: {reply:?}"),
                    _ => panic!("{label}: {route} {reply:?}"),
                }
            }
            assert_eq!(seen.runs(&label), 1, "{label}: {replies:#?}");
            assert_eq!(effects(&db.h.pool, &label).await, 1, "{label}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_twins_of_one_key_run_once_on_pools_of_1_and_16() {
    twins_of_one_key_run_once(Via::Direct).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_twins_of_one_key_run_once_through_pgbouncer() {
    twins_of_one_key_run_once(Via::Bouncer).await;
}

// ---------------------------------------------------------------------------------------------
// 1'. Bodies that meddle with the claim's lock and settings, while twins knock.

/// A handler that, after its effect, forges the claim's lock setting, releases session locks,
/// deallocates every prepared statement, or resets every setting, and then takes a while: its
/// twins on other instances never run the handler while it is in flight, the request's own
/// answer is truthful (a 201 only if its effect committed), and every later answer is that one,
/// replayed, or a run that committed once.
async fn meddling_bodies(via: Via) {
    let db = Db::new(via).await;
    let client = reqwest::Client::new();
    let seen = Arc::new(Seen::default());
    let pool_inbox = db.inbox(4);
    let mut addrs = Vec::new();
    for _ in 0..3 {
        let inbox = Inbox::new(pool_inbox.pool().clone());
        let inbox = if via == Via::Bouncer {
            inbox.with_transaction_pooling()
        } else {
            inbox
        };
        addrs.push(serve(inbox, db.h.pool.clone(), seen.clone()).await);
    }
    let statements = [
        "SELECT set_config('idempotent.http_lock', 'true', true)",
        "SELECT set_config('idempotent.http_lock', 'true', false)",
        "SELECT pg_advisory_unlock_all()",
        "DEALLOCATE ALL",
        "RESET ALL",
    ];
    let mut report = Vec::new();
    for (n, statement) in statements.iter().enumerate() {
        let label = format!("meddling-{n}");
        let order = json!({ "label": label, "after": [statement], "sleep_ms": 400 });
        let first = send(&client, addrs[0], "/pay", &label, &order, None);
        let twins = async {
            tokio::time::sleep(Duration::from_millis(150)).await;
            let calls =
                (0..8).map(|i| send(&client, addrs[1 + i % 2], "/pay", &label, &order, None));
            futures::future::join_all(calls).await
        };
        let (first, twins) = tokio::join!(first, twins);
        let first = first.unwrap();
        for twin in twins {
            let twin = twin.unwrap();
            assert_eq!(
                twin.status, 409,
                "{statement}: a twin while in flight: {twin:?}"
            );
        }
        assert_eq!(seen.runs(&label), 1, "{statement}");
        let committed = effects(&db.h.pool, &label).await;
        if first.status == 201 {
            assert_eq!(
                committed, 1,
                "{statement}: 201 without its effect: {first:?}"
            );
        }
        let retry = settle(&client, addrs[2], "/pay", &label, &order).await;
        let committed = effects(&db.h.pool, &label).await;
        assert!(committed <= 1, "{statement}: {committed} effects");
        if retry.status == 201 {
            assert_eq!(
                committed, 1,
                "{statement}: 201 without its effect: {retry:?}"
            );
        }
        let again = settle(&client, addrs[1], "/pay", &label, &order).await;
        assert_eq!(
            (again.status, again.body.clone()),
            (retry.status, retry.body.clone()),
            "{statement}: the answers differ"
        );
        report.push(format!(
            "{statement}: first {} {} | retry {} replayed={} {} | runs {} effects {}",
            first.status,
            first.code(),
            retry.status,
            retry.replayed,
            retry.code(),
            seen.runs(&label),
            committed
        ));
    }
    eprintln!("{via:?}:\n{}", report.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_bodies_meddling_with_the_claim_neither_let_twins_in_nor_lie() {
    meddling_bodies(Via::Direct).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_bodies_meddling_with_the_claim_through_pgbouncer() {
    meddling_bodies(Via::Bouncer).await;
}

// ---------------------------------------------------------------------------------------------
// 2/3. An HTTP handler with outgoing messages that ends the transaction itself.

/// A handler that queues 1, 2 or 20 outgoing messages (keyed and not) and then ends the claimed
/// transaction (`ROLLBACK`, `COMMIT`, or either followed by a `BEGIN`): never a 201, a 500
/// `transaction_ended` stored and replayed, one run, one effect; the outgoing rows all or none.
async fn http_outbox_then_ending(via: Via) {
    let db = Db::new(via).await;
    let client = reqwest::Client::new();
    let seen = Arc::new(Seen::default());
    let addr = serve(db.inbox(2), db.h.pool.clone(), seen.clone()).await;
    let endings = ["ROLLBACK", "COMMIT", "ROLLBACK; BEGIN", "COMMIT; BEGIN"];
    let mut report = Vec::new();
    for ending in endings {
        for outgoing in [1usize, 2, 20] {
            let label = format!("ends-{ending}-{outgoing}").replace([' ', ';'], "");
            let before = outbox_rows(&db.h.pool).await;
            let order = json!({ "label": label, "outgoing": outgoing, "before": [ending] });
            let first = send(&client, addr, "/pay", &label, &order, None)
                .await
                .unwrap();
            assert_ne!(first.status, 201, "{label}: {first:?}");
            let rows = outbox_rows(&db.h.pool).await - before;
            let committed = effects(&db.h.pool, &label).await;
            let retry = settle(&client, addr, "/pay", &label, &order).await;
            eprintln!(
                "{via:?} {label}: first {} {} | retry {} {} replayed={} | runs {} effects {committed} \
                 (after the retry {}) outbox rows {rows}",
                first.status,
                first.code(),
                retry.status,
                retry.code(),
                retry.replayed,
                seen.runs(&label),
                effects(&db.h.pool, &label).await
            );
            report.push(format!(
                "{label}: first {} {} | retry {} replayed={} | effects {committed} outbox rows {rows}",
                first.status,
                first.code(),
                retry.status,
                retry.replayed
            ));
            assert_eq!(
                (first.status, first.code().as_str()),
                (500, "transaction_ended"),
                "{label}: {first:?}"
            );
            assert_eq!(
                (retry.status, retry.replayed, retry.body.clone()),
                (500, true, first.body.clone()),
                "{label}"
            );
            assert_eq!(seen.runs(&label), 1, "{label}");
            // The effect written after a `ROLLBACK` or `COMMIT` commits on its own; after a
            // `BEGIN` too, it is in the body's own transaction, which the layer rolls back.
            let alone = if ending.ends_with("BEGIN") { 0 } else { 1 };
            assert_eq!(committed, alone, "{label}");
            assert!(
                rows == 0 || rows == outgoing as i64,
                "{label}: {rows} of {outgoing} outgoing rows"
            );
        }
    }
    eprintln!("{via:?}:\n{}", report.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_handler_with_outgoing_messages_that_ends_its_transaction() {
    http_outbox_then_ending(Via::Direct).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_handler_with_outgoing_messages_that_ends_its_transaction_through_pgbouncer() {
    http_outbox_then_ending(Via::Bouncer).await;
}

/// Message handlers (the inbox's own claim) with 1..50 outgoing messages, keyed and unkeyed,
/// whose body ends the transaction in every way short of forging the inbox's mark (and short of
/// `COMMIT; BEGIN; SELECT 1/0`: an aborted transaction is taken for the inbox's, as documented,
/// and reported as a database error though the key committed): never
/// `Ok`, always `TransactionEnded` with `key_committed` as the database has it, or a database
/// error with nothing of the message committed.
async fn outgoing_then_ending(via: Via) {
    let db = Db::new(via).await;
    let inbox = db.inbox(2);
    let endings = [
        "ROLLBACK",
        "COMMIT",
        "ROLLBACK; BEGIN",
        "COMMIT; BEGIN",
        "ROLLBACK; BEGIN; SET LOCAL idempotent.claim = 'off'",
        "SET LOCAL idempotent.claim = 'off'",
    ];
    for (e, ending) in endings.iter().enumerate() {
        for outgoing in [1usize, 2, 7, 50] {
            for keyed in [false, true] {
                let key = format!("m-{e}-{outgoing}-{keyed}");
                let before = outbox_rows(&db.h.pool).await;
                let mut claimed = inbox.claim("orders", &key).await.unwrap().unwrap();
                for n in 0..outgoing {
                    let mut message = OutgoingMessage::new(
                        Destination::queue("q"),
                        format!("{key}-{n}").into_bytes(),
                    );
                    if keyed {
                        message = message.with_ordering_key(format!("o{}", n % 4));
                    }
                    claimed.outbox().send(message);
                }
                sqlx::query("INSERT INTO effects (consumer, label) VALUES ('orders', $1)")
                    .bind(&key)
                    .execute(claimed.connection())
                    .await
                    .unwrap();
                let _ = sqlx::raw_sql(AssertSqlSafe(ending.to_string()))
                    .execute(claimed.connection())
                    .await;
                let outcome = claimed.commit().await;
                let key_row = i64::from(db.h.inbox.is_processed("orders", &key).await.unwrap());
                let rows = outbox_rows(&db.h.pool).await - before;
                let case = format!("{ending} x{outgoing} keyed={keyed}: {outcome:?}");
                match outcome {
                    Ok(()) => panic!("Processed after the body ended it: {case}"),
                    Err(InboxError::TransactionEnded { key_committed, .. }) => {
                        assert_eq!(key_committed, key_row == 1, "{case}");
                    }
                    Err(InboxError::TransactionAborted) => {
                        assert_eq!(key_row, 0, "{case}");
                    }
                    Err(InboxError::Database { .. }) => {
                        // Nothing of the message committed: its redelivery queues it again.
                        assert_eq!((key_row, rows), (0, 0), "{case}");
                    }
                    Err(other) => panic!("{case}: {other}"),
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outgoing_messages_after_an_ended_transaction_are_never_processed() {
    outgoing_then_ending(Via::Direct).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outgoing_messages_after_an_ended_transaction_are_never_processed_through_pgbouncer() {
    outgoing_then_ending(Via::Bouncer).await;
}

// ---------------------------------------------------------------------------------------------
// 4. Pipelined tenants on one connection, bodies that fool the forgetting rule.

fn id() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}

async fn pipelined_tenants(hostile: &[&str]) -> Vec<String> {
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect(&support::postgres::url())
        .await
        .unwrap();
    let id = id();
    let home = format!("home_{id}");
    let names: Vec<String> = (0..3).map(|n| format!("t{n}_{id}")).collect();
    for schema in names.iter().chain([&home]) {
        support::postgres::create_schema_with_effects(&admin, schema).await;
    }
    let options: PgConnectOptions = support::postgres::url().parse().unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with(options.options([("search_path", home.as_str())]));
    Inbox::new(pool.clone()).migrate().await.unwrap();
    let tenants = Tenants::by_schema(
        &Inbox::new(pool.clone()).with_pipelined_claim(),
        names.iter().map(String::as_str),
    )
    .unwrap();
    tenants.migrate().await.unwrap();
    let insert = "INSERT INTO effects (consumer, label) VALUES ('orders', $1)";
    let mut failures = Vec::new();
    for round in 0..4 {
        for (t, name) in names.iter().enumerate() {
            let inbox = tenants.inbox(name).unwrap();
            let key = format!("{round}-{t}");
            let mut claimed = match inbox.claim("orders", &key).await {
                Ok(Some(claimed)) => claimed,
                other => {
                    failures.push(format!("{key}: claim {other:?}"));
                    continue;
                }
            };
            // A statement the driver caches (prepared once per connection).
            let written = sqlx::query(insert)
                .bind(&key)
                .execute(claimed.connection())
                .await;
            if let Err(error) = written {
                failures.push(format!("{key}: the body's cached statement: {error}"));
                claimed.rollback().await;
                continue;
            }
            if round == 1 && t == 0 {
                for statement in hostile {
                    let statement = statement.replace("{other}", &names[1]);
                    let done = sqlx::raw_sql(AssertSqlSafe(statement.clone()))
                        .execute(claimed.connection())
                        .await;
                    assert!(done.is_ok(), "{statement}: {done:?}");
                }
            }
            if let Err(error) = claimed.commit().await {
                failures.push(format!("{key}: commit {error}"));
            }
        }
    }
    failures
}

/// A body that runs `DEALLOCATE ALL` and then prepares a statement of its own whose name begins
/// with `idempotent_claim_`: the driver's statements are gone though the session seems to hold an
/// inbox's claim (it fooled a rule that looked at the claims: sqlx's cache was kept, stale). The
/// later bodies' cached statements must not fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_preparing_an_idempotent_claim_name_after_deallocate_all_breaks_no_later_body() {
    let failures =
        pipelined_tenants(&["DEALLOCATE ALL", "PREPARE idempotent_claim_x AS SELECT 1"]).await;
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A body that deallocates only another tenant's prepared claim (found by name): that tenant's
/// next claim prepares it again and keeps the driver's statements, which are all still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_deallocating_another_tenants_claim_breaks_no_later_body() {
    let failures = pipelined_tenants(&[
        "DO $$ DECLARE n text; BEGIN FOR n IN SELECT name FROM pg_prepared_statements \
         WHERE name LIKE 'idempotent\\_claim\\_%' LOOP EXECUTE format('DEALLOCATE %I', n); \
         EXIT; END LOOP; END $$",
    ])
    .await;
    assert!(failures.is_empty(), "{failures:#?}");
}

/// `DEALLOCATE ALL` alone: every claim and the driver's statements gone; the next claim forgets
/// them (a baseline for the two above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_deallocating_all_breaks_no_later_body() {
    let failures = pipelined_tenants(&["DEALLOCATE ALL"]).await;
    assert!(failures.is_empty(), "{failures:#?}");
}

// ---------------------------------------------------------------------------------------------
// 5. Clients that go away at every point of the claim, on a pool of one.

/// 60 requests on a pool of one connection whose clients give up after 0 to 30 ms (some before
/// the claim, some during it, some while the handler runs): afterwards the pool still serves at
/// once, and each key has run once at most, its retry getting its one run's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_dropped_mid_claim_leave_a_pool_of_one_working() {
    let db = Db::new(Via::Direct).await;
    let client = reqwest::Client::new();
    let seen = Arc::new(Seen::default());
    let addr = serve(db.inbox(1), db.h.pool.clone(), seen.clone()).await;
    let keys: Vec<String> = (0..20).map(|n| format!("drop-{n}")).collect();
    let calls = (0..60).map(|i| {
        let key = keys[i % keys.len()].clone();
        let order = json!({ "label": key, "sleep_ms": (i % 5) * 3 });
        let timeout = Duration::from_millis((i as u64 * 7) % 31);
        let client = &client;
        async move {
            let _ = send(client, addr, "/pay", &key, &order, Some(timeout)).await;
        }
    });
    futures::future::join_all(calls).await;
    let started = Instant::now();
    let fresh = json!({ "label": "fresh" });
    let reply = send(&client, addr, "/pay", "fresh", &fresh, None)
        .await
        .unwrap();
    assert_eq!(reply.status, 201, "{reply:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    for (n, key) in keys.iter().enumerate() {
        let order = json!({ "label": key, "sleep_ms": (n % 5) * 3 });
        let reply = settle(&client, addr, "/pay", key, &order).await;
        assert_eq!(reply.status, 201, "{key}: {reply:?}");
        assert_eq!(seen.runs(key), 1, "{key}");
        assert_eq!(effects(&db.h.pool, key).await, 1, "{key}");
    }
    let total: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idempotent_inbox")
        .fetch_one(&db.h.pool)
        .await
        .unwrap();
    assert_eq!(total, keys.len() as i64 + 1);
}
