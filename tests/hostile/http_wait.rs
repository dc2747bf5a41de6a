//! Hostile tests of `IdempotencyLayer::wait_for_first`: twins that wait, from the public API,
//! against PostgreSQL (`IDEMPOTENT_PG_URL`, a fresh schema per test) and SQLite.

#[path = "schema.rs"]
mod schema;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use idempotent::http::{IdempotencyLayer, IdempotentTx, RequestKey};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

fn scope(_: &axum::http::request::Parts) -> Option<String> {
    Some("client".into())
}

/// Handler runs per body, and what each body asks for.
#[derive(Default)]
struct Seen {
    runs: Mutex<HashMap<String, u64>>,
    total: AtomicU64,
}

impl Seen {
    fn run(&self, body: &str) -> u64 {
        self.total.fetch_add(1, Ordering::SeqCst);
        let mut runs = self.runs.lock().unwrap();
        let run = runs.entry(body.to_owned()).or_default();
        *run += 1;
        *run
    }
    fn runs(&self, body: &str) -> u64 {
        self.runs.lock().unwrap().get(body).copied().unwrap_or(0)
    }
    fn total(&self) -> u64 {
        self.total.load(Ordering::SeqCst)
    }
}

/// The body says what the handler does: `sleep:<ms>`, `hang`, `panic-first:<ms>`,
/// `fail:<ms>` (503 after sleeping), anything else: 201 at once.
async fn act(seen: &Seen, body: &str) -> (StatusCode, String) {
    let run = seen.run(body);
    if let Some(ms) = body.strip_prefix("sleep:") {
        tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
    } else if body == "hang" {
        std::future::pending::<()>().await;
    } else if let Some(ms) = body.strip_prefix("panic-first:") {
        tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
        if run == 1 {
            panic!("the first run panics");
        }
    } else if let Some(ms) = body.strip_prefix("fail:") {
        tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
        return (StatusCode::SERVICE_UNAVAILABLE, format!("fail {run}"));
    }
    (StatusCode::CREATED, format!("run {run} of {body}"))
}

async fn pg_tx(
    State(seen): State<Arc<Seen>>,
    _key: RequestKey,
    mut tx: IdempotentTx<sqlx::Postgres>,
    body: Bytes,
) -> (StatusCode, String) {
    let body = String::from_utf8(body.to_vec()).unwrap();
    sqlx::query("INSERT INTO effects (label) VALUES ($1)")
        .bind(&body)
        .execute(tx.connection())
        .await
        .unwrap();
    act(&seen, &body).await
}

async fn leased(State(seen): State<Arc<Seen>>, body: Bytes) -> (StatusCode, String) {
    let body = String::from_utf8(body.to_vec()).unwrap();
    act(&seen, &body).await
}

struct Pg {
    options: PgConnectOptions,
}

impl Pg {
    async fn new() -> Self {
        let options = schema::fresh_schema().await;
        let pg = Self { options };
        let pool = pg.pool(4).await;
        sqlx::query("CREATE TABLE effects (id bigserial primary key, label text)")
            .execute(&pool)
            .await
            .unwrap();
        idempotent::Inbox::new(pool).migrate().await.unwrap();
        pg
    }

    async fn pool(&self, connections: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(connections)
            .connect_with(self.options.clone())
            .await
            .unwrap()
    }

    async fn effects(&self) -> i64 {
        let pool = self.pool(1).await;
        sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(&pool)
            .await
            .unwrap()
    }
}

/// One instance: `/tx` (transactional) and `/lease` (leased, `lease`), both waiting `patience`.
fn router(
    inbox: idempotent::Inbox<sqlx::Postgres>,
    seen: Arc<Seen>,
    patience: Duration,
    lease: Duration,
) -> Router {
    let tx = IdempotencyLayer::transactional(inbox.clone(), scope).wait_for_first(patience);
    let lease = IdempotencyLayer::leased(inbox, scope, lease)
        .unwrap()
        .wait_for_first(patience);
    Router::new()
        .route("/tx", post(pg_tx).layer(tx))
        .route("/lease", post(leased).layer(lease))
        .with_state(seen)
}

/// An instance (its own inbox, on a pool of `connections`) serving `/tx` and `/lease` with
/// `patience`, a lease of 30 s: its base URL.
async fn instance(pg: &Pg, seen: &Arc<Seen>, patience: Duration, connections: u32) -> String {
    let inbox = idempotent::Inbox::new(pg.pool(connections).await);
    serve(router(
        inbox,
        seen.clone(),
        patience,
        Duration::from_secs(30),
    ))
    .await
}

/// Sends `body` with `key` to `url` in a task of its own.
fn spawn_post(
    http: &reqwest::Client,
    url: String,
    key: &str,
    body: &str,
) -> tokio::task::JoinHandle<Result<(u16, String), reqwest::Error>> {
    let (http, key, body) = (http.clone(), key.to_owned(), body.to_owned());
    tokio::spawn(async move { post_(&http, &url, &key, &body).await })
}

async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    url
}

async fn post_(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    body: &str,
) -> Result<(u16, String), reqwest::Error> {
    let response = client
        .post(url)
        .header("Idempotency-Key", key)
        .body(body.to_owned())
        .send()
        .await?;
    let status = response.status().as_u16();
    Ok((status, response.text().await?))
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap()
}

/// `wait_for_first(Duration::MAX)` reads as "wait as long as it takes": a request must not panic
/// the layer (an `Instant` plus `Duration::MAX` overflows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patience_of_duration_max_answers_and_does_not_panic() {
    let pg = Pg::new().await;
    let seen = Arc::new(Seen::default());
    let inbox = idempotent::Inbox::new(pg.pool(4).await);
    let url = serve(router(
        inbox,
        seen.clone(),
        Duration::MAX,
        Duration::from_secs(30),
    ))
    .await;
    let http = client();
    for route in ["tx", "lease"] {
        let key = format!("max-{route}");
        let answered = post_(&http, &format!("{url}/{route}"), &key, "plain").await;
        assert!(
            matches!(answered, Ok((201, _))),
            "{route}: a request behind wait_for_first(Duration::MAX): {answered:?}"
        );
    }
}

/// A twin with another body waits for the first, then gets 422; its body never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_twin_with_another_body_waits_then_gets_422_and_never_runs() {
    let pg = Pg::new().await;
    let seen = Arc::new(Seen::default());
    let a = instance(&pg, &seen, Duration::from_secs(10), 4).await;
    let b = instance(&pg, &seen, Duration::from_secs(10), 4).await;
    let http = client();
    for route in ["tx", "lease"] {
        let key = format!("other-body-{route}");
        let first = spawn_post(&http, format!("{a}/{route}"), &key, "sleep:500");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let twins: Vec<_> = (0..10)
            .map(|i| {
                let url = format!("{}/{route}", if i % 2 == 0 { &a } else { &b });
                spawn_post(&http, url, &key, "sleep:501")
            })
            .collect();
        assert_eq!(first.await.unwrap().unwrap().0, 201);
        for twin in twins {
            let (status, body) = twin.await.unwrap().unwrap();
            assert_eq!(status, 422, "{route}: {body}");
        }
        assert_eq!(seen.runs("sleep:501"), 0, "{route}");
        assert_eq!(seen.runs("sleep:500"), 1, "{route}");
        seen.runs.lock().unwrap().clear();
    }
}

/// A twin whose client gives up while it waits leaves nothing behind: the first's answer is
/// stored, the key is usable afterwards (a replay), the handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_twin_whose_client_went_away_while_waiting_leaks_nothing() {
    let pg = Pg::new().await;
    let seen = Arc::new(Seen::default());
    let a = instance(&pg, &seen, Duration::from_secs(10), 4).await;
    let b = instance(&pg, &seen, Duration::from_secs(10), 4).await;
    let http = client();
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(150))
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    for route in ["tx", "lease"] {
        let key = format!("gone-{route}");
        let first = spawn_post(&http, format!("{a}/{route}"), &key, "sleep:800");
        tokio::time::sleep(Duration::from_millis(50)).await;
        // Twins on both instances whose clients give up after 150 ms.
        for url in [&a, &b, &a, &b] {
            let gave_up = post_(&impatient, &format!("{url}/{route}"), &key, "sleep:800").await;
            assert!(gave_up.is_err(), "{gave_up:?}");
        }
        assert_eq!(first.await.unwrap().unwrap().0, 201);
        // The key is usable afterwards, at once, on both instances: replays.
        for url in [&a, &b] {
            let (status, body) = post_(&http, &format!("{url}/{route}"), &key, "sleep:800")
                .await
                .unwrap();
            assert_eq!(
                (status, body.as_str()),
                (201, "run 1 of sleep:800"),
                "{route}"
            );
        }
        assert_eq!(seen.runs("sleep:800"), 1, "{route}");
        seen.runs.lock().unwrap().clear();
    }
    assert_eq!(pg.effects().await, 1);
}

/// A first request that never answers: twins (same instance and the other) get 409 once their
/// patience is over, not a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twins_of_a_first_that_hangs_get_409_after_their_patience() {
    let pg = Pg::new().await;
    let seen = Arc::new(Seen::default());
    let patience = Duration::from_millis(700);
    let a = instance(&pg, &seen, patience, 4).await;
    let b = instance(&pg, &seen, patience, 4).await;
    let http = client();
    for route in ["tx", "lease"] {
        let key = format!("hang-{route}");
        let _first = spawn_post(&http, format!("{a}/{route}"), &key, "hang");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let started = Instant::now();
        let twins: Vec<_> = (0..20)
            .map(|i| {
                let url = format!("{}/{route}", if i % 2 == 0 { &a } else { &b });
                spawn_post(&http, url, &key, "hang")
            })
            .collect();
        for twin in twins {
            let answered = tokio::time::timeout(Duration::from_secs(5), twin)
                .await
                .expect("a twin hung past its patience")
                .unwrap()
                .unwrap();
            assert_eq!(answered.0, 409, "{route}: {}", answered.1);
        }
        let took = started.elapsed();
        assert!(took >= patience, "{route}: {took:?}");
        assert_eq!(seen.runs("hang"), 1, "{route}");
        seen.runs.lock().unwrap().clear();
    }
}

/// A first whose handler panics: one twin runs it again, the others get its replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twins_of_a_first_that_panicked_run_it_once_more() {
    let pg = Pg::new().await;
    let seen = Arc::new(Seen::default());
    let a = instance(&pg, &seen, Duration::from_secs(10), 4).await;
    let http = client();
    for route in ["tx", "lease"] {
        let key = format!("panic-{route}");
        let body = format!("panic-first:{}", if route == "tx" { 300 } else { 301 });
        let first = spawn_post(&http, format!("{a}/{route}"), &key, &body);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let twins: Vec<_> = (0..20)
            .map(|_| spawn_post(&http, format!("{a}/{route}"), &key, &body))
            .collect();
        let first = first.await.unwrap().unwrap();
        assert!(first.0 >= 500, "{route}: {first:?}");
        let mut statuses = Vec::new();
        for twin in twins {
            statuses.push(twin.await.unwrap().unwrap());
        }
        if route == "lease" {
            // A leased route's panic leaves the key pending for its lease (documented): twins 409.
            eprintln!("lease twins of a panicked first: {statuses:?}");
        } else {
            assert!(
                statuses.iter().all(|(s, _)| *s == 201),
                "{route}: {statuses:?}"
            );
            assert_eq!(seen.runs(&body), 2, "{route}");
        }
    }
}

/// A handler that always answers 503 (not stored): twins take turns, each runs at most once,
/// and nobody waits much beyond the patience.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twins_of_a_handler_that_keeps_failing_each_run_once_within_patience() {
    let pg = Pg::new().await;
    let seen = Arc::new(Seen::default());
    let patience = Duration::from_millis(600);
    let a = instance(&pg, &seen, patience, 4).await;
    let b = instance(&pg, &seen, patience, 4).await;
    let http = client();
    for route in ["tx", "lease"] {
        let key = format!("fail-{route}");
        let started = Instant::now();
        let twins: Vec<_> = (0..30)
            .map(|i| {
                let url = format!("{}/{route}", if i % 2 == 0 { &a } else { &b });
                spawn_post(&http, url, &key, "fail:100")
            })
            .collect();
        let mut statuses: HashMap<u16, u64> = HashMap::new();
        for twin in twins {
            let (status, _) = twin.await.unwrap().unwrap();
            *statuses.entry(status).or_default() += 1;
        }
        let took = started.elapsed();
        let runs = seen.runs("fail:100");
        eprintln!("{route}: {statuses:?} runs {runs} in {took:?}");
        assert_eq!(statuses.get(&503).copied().unwrap_or(0), runs, "{route}");
        assert!(runs <= 30);
        // Each run is 100 ms; twins enter before their patience is over, so at most patience +
        // one run, and a busy machine's slack: not a wait without end.
        assert!(
            took < patience + Duration::from_secs(5),
            "{route}: {took:?}"
        );
        seen.runs.lock().unwrap().clear();
    }
}

/// Patience zero: a twin gets 409 at once, as without the option.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patience_of_zero_answers_409_at_once() {
    let pg = Pg::new().await;
    let seen = Arc::new(Seen::default());
    let a = instance(&pg, &seen, Duration::ZERO, 4).await;
    let http = client();
    for route in ["tx", "lease"] {
        let key = format!("zero-{route}");
        let first = spawn_post(&http, format!("{a}/{route}"), &key, "sleep:500");
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (status, _) = post_(&http, &format!("{a}/{route}"), &key, "sleep:500")
            .await
            .unwrap();
        assert_eq!(status, 409, "{route}");
        assert!(
            !first.is_finished(),
            "{route}: the twin waited for the first"
        );
        assert_eq!(first.await.unwrap().unwrap().0, 201);
    }
}

/// 300 twins on one instance and 100 on another, transactional route, a pool of ONE connection
/// per instance: one run, all others replays, nothing times out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_twins_on_pools_of_one_connection() {
    let pg = Pg::new().await;
    let seen = Arc::new(Seen::default());
    let a = instance(&pg, &seen, Duration::from_secs(20), 1).await;
    let b = instance(&pg, &seen, Duration::from_secs(20), 1).await;
    let http = client();
    for route in ["tx", "lease"] {
        let key = format!("many-{route}");
        let twins: Vec<_> = (0..400)
            .map(|i| {
                let url = format!("{}/{route}", if i % 4 == 3 { &b } else { &a });
                spawn_post(&http, url, &key, "sleep:300")
            })
            .collect();
        let mut statuses: HashMap<u16, u64> = HashMap::new();
        for twin in twins {
            let (status, _) = twin.await.unwrap().unwrap();
            *statuses.entry(status).or_default() += 1;
        }
        assert_eq!(statuses, HashMap::from([(201, 400)]), "{route}");
        assert_eq!(seen.runs("sleep:300"), 1, "{route}");
        seen.runs.lock().unwrap().clear();
    }
}

/// A transactional and a leased route sharing the consumer, on two instances, twins waiting:
/// one handler runs for the key (the other route's twins get 422: another fingerprint).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twins_across_a_transactional_and_a_leased_route_run_one_handler() {
    let pg = Pg::new().await;
    let seen = Arc::new(Seen::default());
    let patience = Duration::from_secs(10);
    let a = instance(&pg, &seen, patience, 4).await;
    let b = instance(&pg, &seen, patience, 4).await;
    let http = client();
    let twins: Vec<_> = (0..40)
        .map(|i| {
            let url = format!(
                "{}/{}",
                if i % 2 == 0 { &a } else { &b },
                if i % 3 == 0 { "tx" } else { "lease" }
            );
            let http = http.clone();
            tokio::spawn(async move { post_(&http, &url, "shared", "sleep:200").await })
        })
        .collect();
    let mut statuses: HashMap<u16, u64> = HashMap::new();
    for twin in twins {
        let (status, _) = twin.await.unwrap().unwrap();
        *statuses.entry(status).or_default() += 1;
    }
    eprintln!("{statuses:?}");
    assert_eq!(seen.total(), 1, "{statuses:?}");
    assert_eq!(statuses.get(&409), None, "{statuses:?}");
}
