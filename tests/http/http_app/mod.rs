//! The app `tests/http/http.rs` runs: its routes and handlers on each backend, a server on a runtime of
//! its own (so that a test can kill it), a client, and the database's counts.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::Response;
use axum::routing::post;
use idempotent::http::{IdempotencyLayer, RequestKey};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::Notify;

use crate::support;

/// What the handler does, sent as the request's body (so it is part of the fingerprint).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Order {
    pub label: String,
    /// Sleeps this long after writing its effect (before it, on `/emails`).
    pub sleep_ms: u64,
    /// On its first run for this label: signals, then never answers (after writing its effect on
    /// `/payments`, before it on `/emails`).
    pub hang_first: bool,
    /// Answers with this status (201 by default).
    pub status: Option<u16>,
    /// Answers 500 on its first run for this label.
    pub fail_first: bool,
    /// Pads the JSON answer with this many bytes.
    pub pad: usize,
    /// Streams this many chunks of 512 bytes instead of a JSON answer.
    pub chunks: usize,
    /// On its first run for this label, `/payments` runs `DEALLOCATE ALL` (PostgreSQL) after its
    /// effect: the connection's prepared statements are gone.
    pub deallocate_first: bool,
    /// `/payments` sends this statement (`ROLLBACK`, `COMMIT`) before its effect: the handler ends
    /// the claimed transaction itself, and its effect commits on its own.
    pub end_transaction: Option<String>,
    /// `/emails`, after its effect: signals `effect_written`, then waits for `go` before it
    /// answers.
    pub wait_after_effect: bool,
}

/// What the test sees of the server's handlers, whichever server runs them.
#[derive(Default)]
pub struct Seen {
    /// Handler runs per label.
    pub runs: Mutex<HashMap<String, u64>>,
    /// A hanging handler has started.
    pub hanging: Notify,
    /// A handler told to wait after its effect has written it.
    pub effect_written: Notify,
    /// Lets a handler that waits after its effect answer.
    pub go: Notify,
}

impl Seen {
    pub fn run(&self, label: &str) -> u64 {
        let mut runs = self.runs.lock().unwrap();
        let run = runs.entry(label.to_owned()).or_default();
        *run += 1;
        *run
    }

    pub fn runs(&self, label: &str) -> u64 {
        self.runs.lock().unwrap().get(label).copied().unwrap_or(0)
    }
}

/// How the test configures the layers.
#[derive(Clone)]
pub struct Setup {
    pub lease: Duration,
    pub max_stored_body: usize,
    /// The server's pool.
    pub connections: u32,
    /// The leased layer's `store_patience`, if set.
    pub store_patience: Option<Duration>,
    /// The layers' documentation URI, if set.
    pub documentation: Option<&'static str>,
    /// The layers' `wait_for_first`, if set.
    pub wait_for_first: Option<Duration>,
}

impl Default for Setup {
    fn default() -> Self {
        Self {
            lease: Duration::from_secs(30),
            max_stored_body: idempotent::http::DEFAULT_MAX_STORED_BODY,
            connections: 16,
            store_patience: None,
            documentation: None,
            wait_for_first: None,
        }
    }
}

/// The client is named by the `x-client` header.
pub fn scope(parts: &axum::http::request::Parts) -> Option<String> {
    parts
        .headers
        .get("x-client")
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned)
}

/// The answer of a handler that ran, after its effect: what the order asks for.
async fn answer(order: &Order, run: u64) -> Response {
    tokio::time::sleep(Duration::from_millis(order.sleep_ms)).await;
    let status = if order.fail_first && run == 1 {
        500
    } else {
        order.status.unwrap_or(201)
    };
    let builder = Response::builder()
        .status(status)
        .header(header::LOCATION, format!("/payments/{}", order.label))
        .header(header::SET_COOKIE, "session=first-exchange-only");
    if order.chunks > 0 {
        let chunks = (0..order.chunks).map(|_| Ok::<_, std::io::Error>(vec![b'x'; 512]));
        let stream = futures::StreamExt::then(futures::stream::iter(chunks), |chunk| async {
            tokio::time::sleep(Duration::from_millis(5)).await;
            chunk
        });
        return builder
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .body(Body::from_stream(stream))
            .unwrap();
    }
    let body = json!({ "label": order.label, "run": run, "pad": "x".repeat(order.pad) });
    builder
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .unwrap()
}

/// The app on one backend: its routes and handlers, and how its effects are counted.
macro_rules! app_for {
    ($db:ty) => {
        use super::*;
        use idempotent::http::IdempotentTx;

        #[derive(Clone)]
        pub struct App {
            pool: sqlx::Pool<$db>,
            seen: Arc<Seen>,
        }

        const INSERT: &str = "INSERT INTO effects (consumer, label) VALUES ($1, $2)";

        pub fn router(pool: sqlx::Pool<$db>, seen: Arc<Seen>, setup: &Setup) -> Router {
            let inbox = idempotent::Inbox::new(pool.clone());
            let mut payments = IdempotencyLayer::transactional(inbox.clone(), scope)
                .max_stored_body(setup.max_stored_body);
            let mut emails = IdempotencyLayer::leased(inbox, scope, setup.lease)
                .unwrap()
                .max_stored_body(setup.max_stored_body);
            if let Some(patience) = setup.store_patience {
                emails = emails.store_patience(patience);
            }
            if let Some(uri) = setup.documentation {
                let uri: axum::http::Uri = uri.parse().unwrap();
                payments = payments.documentation(uri.clone());
                emails = emails.documentation(uri);
            }
            if let Some(patience) = setup.wait_for_first {
                payments = payments.wait_for_first(patience);
                emails = emails.wait_for_first(patience);
            }
            Router::new()
                .route("/payments", post(payments_handler).layer(payments))
                .route("/emails", post(emails_handler).layer(emails))
                .with_state(App { pool, seen })
        }

        /// Writes its effect in the claimed transaction.
        async fn payments_handler(
            State(app): State<App>,
            _key: RequestKey,
            mut tx: IdempotentTx<$db>,
            axum::Json(order): axum::Json<Order>,
        ) -> Response {
            let run = app.seen.run(&order.label);
            if let Some(statement) = &order.end_transaction {
                let ended = sqlx::raw_sql(sqlx::AssertSqlSafe(statement.clone()))
                    .execute(tx.connection())
                    .await;
                if let Err(error) = ended {
                    // SQLite refuses a `COMMIT` that is not the inbox's own.
                    return Response::builder()
                        .status(500)
                        .body(Body::from(format!("{statement} failed: {error}")))
                        .unwrap();
                }
            }
            let written = sqlx::query(INSERT)
                .bind("payments")
                .bind(&order.label)
                .execute(tx.connection())
                .await;
            if let Err(error) = written {
                // SQLite refuses a write after the handler ended the transaction itself.
                return Response::builder()
                    .status(500)
                    .body(Body::from(format!("the effect failed: {error}")))
                    .unwrap();
            }
            if order.deallocate_first && run == 1 {
                sqlx::query("DEALLOCATE ALL")
                    .execute(tx.connection())
                    .await
                    .unwrap();
            }
            if order.hang_first && run == 1 {
                app.seen.hanging.notify_one();
                std::future::pending::<()>().await;
            }
            answer(&order, run).await
        }

        /// Writes its effect on its own, as an outside service would, when it succeeds.
        async fn emails_handler(
            State(app): State<App>,
            axum::Json(order): axum::Json<Order>,
        ) -> Response {
            let run = app.seen.run(&order.label);
            if order.hang_first && run == 1 {
                app.seen.hanging.notify_one();
                std::future::pending::<()>().await;
            }
            let response = answer(&order, run).await;
            if response.status().is_success() {
                sqlx::query(INSERT)
                    .bind("emails")
                    .bind(&order.label)
                    .execute(&app.pool)
                    .await
                    .unwrap();
                if order.wait_after_effect {
                    app.seen.effect_written.notify_one();
                    app.seen.go.notified().await;
                }
            }
            response
        }
    };
}

mod pg_app {
    app_for!(sqlx::Postgres);
}

mod sqlite_app {
    app_for!(sqlx::Sqlite);
}

/// A server on its own runtime, so that a test can kill it mid-request, tasks and all.
pub struct Server {
    pub addr: SocketAddr,
    pub runtime: Option<tokio::runtime::Runtime>,
}

impl Server {
    /// Starts the router `make` builds (on the server's runtime, so that its pool is the server's
    /// own) on 127.0.0.1 and a free port.
    pub fn start<F, Fut>(make: F) -> Server
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Router> + Send + 'static,
    {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let (ready, addr) = std::sync::mpsc::channel();
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            ready.send(listener.local_addr().unwrap()).unwrap();
            axum::serve(listener, make().await).await.unwrap();
        });
        Server {
            addr: addr.recv().unwrap(),
            runtime: Some(runtime),
        }
    }

    /// Kills the server at once: every task is dropped where it is, its connections closed.
    pub fn kill(mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// An answer, as the client saw it.
pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
    pub elapsed: Duration,
    /// When the whole answer had arrived.
    pub finished: Instant,
}

impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let body = String::from_utf8_lossy(&self.body);
        f.debug_struct("Reply")
            .field("status", &self.status)
            .field("headers", &self.headers)
            .field("body", &body.chars().take(300).collect::<String>())
            .field("elapsed", &self.elapsed)
            .finish()
    }
}

impl Reply {
    pub fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    /// The problem's `code`, for the layer's own answers.
    pub fn code(&self) -> String {
        self.json()["code"].as_str().unwrap_or_default().to_owned()
    }

    /// Which run of the handler made this answer.
    pub fn run(&self) -> u64 {
        self.json()["run"].as_u64().unwrap_or(0)
    }

    pub fn retry_after(&self) -> Option<u64> {
        self.headers
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok()?.parse().ok())
    }
}

/// A request to send.
pub struct Call {
    pub route: String,
    pub client: Option<String>,
    pub keys: Vec<Vec<u8>>,
    pub order: Value,
    pub timeout: Option<Duration>,
}

impl Call {
    pub fn new(route: &str, key: &str, order: Value) -> Self {
        Self {
            route: route.to_owned(),
            client: Some("client-a".to_owned()),
            keys: vec![key.as_bytes().to_vec()],
            order,
            timeout: None,
        }
    }

    pub fn client(self, client: Option<&str>) -> Self {
        Self {
            client: client.map(str::to_owned),
            ..self
        }
    }

    pub fn keys(self, keys: &[&[u8]]) -> Self {
        Self {
            keys: keys.iter().map(|key| key.to_vec()).collect(),
            ..self
        }
    }

    pub fn timeout(self, timeout: Duration) -> Self {
        Self {
            timeout: Some(timeout),
            ..self
        }
    }
}

/// One backend: a fresh database, the server(s) on it, and a client.
pub trait Backend: Sized + Send + Sync + 'static {
    /// The database lets one transaction write at a time (SQLite).
    const ONE_WRITER: bool;

    async fn fresh() -> Self;

    /// Blocks every write to the inbox's tables from another session, until released.
    async fn block_writes(&self) -> WritesBlocked;

    /// Starts a server of the app on this database, with its own pool and layers.
    fn serve(&self, seen: Arc<Seen>, setup: Setup) -> Server;

    /// The committed effects of `route` ("payments", "emails") for `label`.
    async fn effects(&self, route: &str, label: &str) -> i64;

    /// Moves the layers' stored responses `by` into the past.
    async fn backdate_http(&self, by: Duration);

    /// Runs the purge of a layer's inbox on this database; the rows it deleted.
    async fn purge(&self) -> u64;
}

/// Writes to the inbox's tables held up by another session's lock, until [`release`]d.
pub struct WritesBlocked {
    release: Option<tokio::sync::oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<()>,
}

impl WritesBlocked {
    /// Takes the lock with `statements` on a connection of `pool`, and holds it until released.
    pub async fn take<DB: sqlx::Database>(
        pool: &sqlx::Pool<DB>,
        statements: &'static [&'static str],
    ) -> Self
    where
        for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    {
        let mut conn = pool.acquire().await.unwrap();
        for statement in statements {
            sqlx::raw_sql(sqlx::AssertSqlSafe(*statement))
                .execute(&mut *conn)
                .await
                .unwrap();
        }
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let done = tokio::spawn(async move {
            let _ = released.await;
            sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.unwrap();
        });
        Self {
            release: Some(release),
            done,
        }
    }

    /// Ends the other session's transaction, and its lock.
    pub async fn release(mut self) {
        drop(self.release.take());
        (&mut self.done).await.unwrap();
    }
}

macro_rules! backend_for {
    ($name:ident, $harness:ty, $app:ident, $pool_options:ty, $one_writer:expr, $block:expr) => {
        pub struct $name(pub $harness);

        impl Backend for $name {
            const ONE_WRITER: bool = $one_writer;

            async fn fresh() -> Self {
                Self(<$harness>::new().await)
            }

            async fn block_writes(&self) -> WritesBlocked {
                WritesBlocked::take(&self.0.pool, $block).await
            }

            fn serve(&self, seen: Arc<Seen>, setup: Setup) -> Server {
                let options = self.0.pool.connect_options().as_ref().clone();
                Server::start(move || async move {
                    let pool = <$pool_options>::new()
                        .max_connections(setup.connections)
                        .connect_with(options)
                        .await
                        .unwrap();
                    $app::router(pool, seen, &setup)
                })
            }

            async fn effects(&self, route: &str, label: &str) -> i64 {
                use support::Harness;
                self.0.effects_of(route, label).await
            }

            async fn backdate_http(&self, by: Duration) {
                use support::Harness;
                self.0
                    .backdate(idempotent::http::DEFAULT_CONSUMER, by)
                    .await
            }

            async fn purge(&self) -> u64 {
                let layer = IdempotencyLayer::transactional(self.0.inbox.clone(), scope);
                layer.inbox().purge_expired(100).await.unwrap().deleted
            }
        }
    };
}

backend_for!(
    Pg,
    support::postgres::PgHarness,
    pg_app,
    sqlx::postgres::PgPoolOptions,
    false,
    &[
        "BEGIN",
        "LOCK TABLE idempotent_inbox, idempotent_inbox_calls IN EXCLUSIVE MODE"
    ]
);
backend_for!(
    Lite,
    support::sqlite::SqliteHarness,
    sqlite_app,
    sqlx::sqlite::SqlitePoolOptions,
    true,
    &["BEGIN IMMEDIATE"]
);

/// A backend with a server on it, and the client.
pub struct Api<B: Backend> {
    pub db: B,
    pub server: Server,
    pub seen: Arc<Seen>,
    pub setup: Setup,
    pub client: reqwest::Client,
}

impl<B: Backend> Api<B> {
    pub async fn start(setup: Setup) -> Self {
        let db = B::fresh().await;
        let seen = Arc::new(Seen::default());
        let server = db.serve(seen.clone(), setup.clone());
        Self {
            db,
            server,
            seen,
            setup,
            client: reqwest::Client::new(),
        }
    }

    /// Another server of the app on the same database: another instance, with layers of its own.
    pub fn another_instance(&self) -> Server {
        self.db.serve(self.seen.clone(), self.setup.clone())
    }

    /// Kills the server (mid-request, if it has one) and starts a new one on the same database.
    pub fn kill_and_restart(&mut self) {
        let restarted = self.another_instance();
        let killed = std::mem::replace(&mut self.server, restarted);
        killed.kill();
    }

    /// Sends `call`, whose handler hangs, and returns once it hangs (the client gives up on it).
    pub async fn until_hanging(&self, call: Call) {
        tokio::select! {
            reply = self.send(call) => panic!("the handler was to hang: {reply:?}"),
            () = self.seen.hanging.notified() => {}
        }
    }

    /// Waits until the handler has run `runs` times for `label`.
    pub async fn until_runs(&self, label: &str, runs: u64) {
        for _ in 0..500 {
            if self.seen.runs(label) >= runs {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the handler never ran for {label}");
    }

    pub async fn send(&self, call: Call) -> Result<Reply, reqwest::Error> {
        self.send_to(&self.server, call).await
    }

    pub async fn send_to(&self, server: &Server, call: Call) -> Result<Reply, reqwest::Error> {
        let mut request = self
            .client
            .post(format!("http://{}{}", server.addr, call.route))
            .header(header::CONTENT_TYPE, "application/json")
            .body(call.order.to_string());
        if let Some(client) = call.client {
            request = request.header("x-client", client);
        }
        for key in call.keys {
            request = request.header(
                "idempotency-key",
                reqwest::header::HeaderValue::from_bytes(&key).unwrap(),
            );
        }
        if let Some(timeout) = call.timeout {
            request = request.timeout(timeout);
        }
        let started = Instant::now();
        let response = request.send().await?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response.bytes().await?.to_vec();
        Ok(Reply {
            status,
            headers,
            body,
            elapsed: started.elapsed(),
            finished: Instant::now(),
        })
    }

    /// Sends `call` until it is no longer refused as in flight (at most `patience`).
    pub async fn settle(&self, call: impl Fn() -> Call, patience: Duration) -> Reply {
        let deadline = Instant::now() + patience;
        loop {
            let reply = self.send(call()).await.unwrap();
            if reply.status != 409 || Instant::now() > deadline {
                return reply;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
