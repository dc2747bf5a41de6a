//! A payments API whose `POST` routes accept an `Idempotency-Key`, with a client that retries the
//! way real clients do: after a lost answer, twice at the same moment, with a changed body, with no
//! key, as another client. Runs on SQLite with no setup, and prints each exchange.
//!
//! ```text
//! cargo run --example http_payments --features http
//! ```
//!
//! - `POST /payments` writes to the database: its handler takes the claimed transaction
//!   (`IdempotentTx`), so the payment, the key and the stored response commit together.
//! - `POST /receipts` sends an email (here: a line on the screen and a counter) and does not touch
//!   the database: its layer records a pending call with a lease instead. Its twins wait for the
//!   first request (`wait_for_first`) and get its answer, where a payment's twin gets `409`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use idempotent::http::{IdempotencyLayer, IdempotentTx, RequestKey};
use serde::Deserialize;
use serde_json::{Value, json};

/// The authenticated client, put in the request's extensions by `authenticate`.
#[derive(Clone)]
struct Client(String);

/// A toy authentication layer: the bearer token is the client's name.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let client = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .map(|token| Client(token.to_owned()));
    match client {
        Some(client) => {
            request.extensions_mut().insert(client);
            next.run(request).await
        }
        None => StatusCode::UNAUTHORIZED.into_response(),
    }
}

/// The scope of a request's key: its authenticated client.
fn client_of(parts: &axum::http::request::Parts) -> Option<String> {
    parts
        .extensions
        .get::<Client>()
        .map(|client| client.0.clone())
}

#[derive(Deserialize)]
struct NewPayment {
    amount_cents: i64,
    currency: String,
}

#[derive(Clone)]
struct App {
    emails_sent: Arc<AtomicU64>,
}

/// Records a payment, once per key and client.
async fn create_payment(
    key: RequestKey,
    mut tx: IdempotentTx<sqlx::Sqlite>,
    Json(payment): Json<NewPayment>,
) -> Result<(StatusCode, [(header::HeaderName, String); 1], Json<Value>), (StatusCode, String)> {
    if payment.amount_cents <= 0 {
        // A client error: stored and replayed like a success.
        return Err((
            StatusCode::BAD_REQUEST,
            "the amount must be positive".into(),
        ));
    }
    tokio::time::sleep(Duration::from_millis(300)).await; // the bank takes a moment
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO payments (client, amount_cents, currency) VALUES ($1, $2, $3) RETURNING id",
    )
    .bind(key.scope())
    .bind(payment.amount_cents)
    .bind(&payment.currency)
    .fetch_one(tx.connection())
    .await
    .map_err(|error| (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()))?;
    Ok((
        StatusCode::CREATED,
        [(header::LOCATION, format!("/payments/{id}"))],
        Json(json!({ "id": id, "amount_cents": payment.amount_cents })),
    ))
}

/// Sends a receipt by email: an outside effect, outside the database.
async fn send_receipt(State(app): State<App>, key: RequestKey) -> (StatusCode, Json<Value>) {
    tokio::time::sleep(Duration::from_millis(300)).await; // the mail service takes a moment
    let sent = app.emails_sent.fetch_add(1, Ordering::SeqCst) + 1;
    // A real mail service would get `key.idempotency_key()` as its own idempotency key.
    println!(
        "      (server: email sent to {}, idempotency key {}…)",
        key.scope(),
        &key.idempotency_key().as_str()[..12]
    );
    (StatusCode::ACCEPTED, Json(json!({ "email": sent })))
}

async fn serve(pool: sqlx::SqlitePool, app: App) -> Result<String, Box<dyn std::error::Error>> {
    let inbox = idempotent::Inbox::new(pool);
    inbox.migrate().await?;
    let payments = IdempotencyLayer::transactional(inbox.clone(), client_of);
    // A receipt's twin waits up to 10 s for the first request, then gets its answer (not a 409).
    let receipts = IdempotencyLayer::leased(inbox, client_of, Duration::from_secs(30))?
        .wait_for_first(Duration::from_secs(10));
    // Stored responses expire after 24 hours; this purger deletes them.
    payments
        .inbox()
        .spawn_purger(idempotent::PurgerOptions::every(Duration::from_secs(600)))
        .detach();
    let router = Router::new()
        .route("/payments", post(create_payment).layer(payments))
        .route("/receipts", post(send_receipt).layer(receipts))
        .layer(middleware::from_fn(authenticate))
        .with_state(app);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(url)
}

/// Sends one request and prints it with its answer; the answer's status and JSON body.
async fn exchange(
    http: &reqwest::Client,
    url: &str,
    what: &str,
    client: &str,
    key: Option<&str>,
    body: Value,
) -> Result<(u16, Value), reqwest::Error> {
    let mut request = http
        .post(url)
        .bearer_auth(client)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.to_string());
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    let response = request.send().await?;
    let status = response.status().as_u16();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let retry_after = response
        .headers()
        .get(header::RETRY_AFTER)
        .map(|value| format!(", Retry-After: {}", value.to_str().unwrap_or("?")))
        .unwrap_or_default();
    let text = response.text().await?;
    let json: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    let shown = json
        .get("detail")
        .cloned()
        .unwrap_or_else(|| json.clone())
        .to_string();
    println!(
        "{what:<46} → {status}{}{retry_after}  {shown}",
        if replayed { " (replayed)" } else { "" },
    );
    Ok((status, json))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::temp_dir().join("idempotent-http-payments.db");
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    println!("running on SQLite at {}\n", path.display());
    let options = idempotent::sqlite::connect_options(&format!("sqlite://{}", path.display()))?;
    let pool = sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await?;
    sqlx::query(
        "CREATE TABLE payments (id INTEGER PRIMARY KEY AUTOINCREMENT, client TEXT NOT NULL,
                                amount_cents INTEGER NOT NULL, currency TEXT NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let emails_sent = Arc::new(AtomicU64::new(0));
    let base = serve(
        pool.clone(),
        App {
            emails_sent: emails_sent.clone(),
        },
    )
    .await?;
    let (payments, receipts) = (format!("{base}/payments"), format!("{base}/receipts"));
    let http = reqwest::Client::new();
    let pay = |cents: i64| json!({ "amount_cents": cents, "currency": "EUR" });

    let (_, first) = exchange(
        &http,
        &payments,
        "alice pays 12.50, key order-1",
        "alice",
        Some("order-1"),
        pay(1250),
    )
    .await?;
    let (_, again) = exchange(
        &http,
        &payments,
        "alice retries (the answer was lost)",
        "alice",
        Some("order-1"),
        pay(1250),
    )
    .await?;
    assert_eq!(first, again, "the retry gets the first answer");

    println!();
    let (a, b) = tokio::join!(
        exchange(
            &http,
            &payments,
            "alice pays 40.00, key order-2, from one tab",
            "alice",
            Some("order-2"),
            pay(4000)
        ),
        async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            exchange(
                &http,
                &payments,
                "… and at the same moment from another",
                "alice",
                Some("order-2"),
                pay(4000),
            )
            .await
        }
    );
    let mut statuses = [a?.0, b?.0];
    statuses.sort();
    assert_eq!(statuses, [201, 409]);

    println!();
    exchange(
        &http,
        &payments,
        "alice reuses order-1 for 99.99",
        "alice",
        Some("order-1"),
        pay(9999),
    )
    .await?;
    exchange(
        &http,
        &payments,
        "alice pays without a key",
        "alice",
        None,
        pay(500),
    )
    .await?;
    exchange(
        &http,
        &payments,
        "alice sends a key with a space",
        "alice",
        Some("order 3"),
        pay(500),
    )
    .await?;
    exchange(
        &http,
        &payments,
        "bob happens to use order-1 too",
        "bob",
        Some("order-1"),
        pay(700),
    )
    .await?;
    exchange(
        &http,
        &payments,
        "bob pays -5.00, key order-9",
        "bob",
        Some("order-9"),
        pay(-500),
    )
    .await?;
    exchange(
        &http,
        &payments,
        "bob retries it",
        "bob",
        Some("order-9"),
        pay(-500),
    )
    .await?;

    println!();
    exchange(
        &http,
        &receipts,
        "alice asks for a receipt, key receipt-1",
        "alice",
        Some("receipt-1"),
        json!({ "payment": 1 }),
    )
    .await?;
    exchange(
        &http,
        &receipts,
        "alice asks again",
        "alice",
        Some("receipt-1"),
        json!({ "payment": 1 }),
    )
    .await?;

    let (a, b) = tokio::join!(
        exchange(
            &http,
            &receipts,
            "alice asks for receipt-2 from one tab",
            "alice",
            Some("receipt-2"),
            json!({ "payment": 2 }),
        ),
        async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            exchange(
                &http,
                &receipts,
                "… and from another: it waits for the first",
                "alice",
                Some("receipt-2"),
                json!({ "payment": 2 }),
            )
            .await
        }
    );
    let (a, b) = (a?, b?);
    assert_eq!((a.0, b.0), (202, 202));
    assert_eq!(a.1, b.1, "the twin gets the first's answer");

    let rows: Vec<(i64, String, i64)> =
        sqlx::query_as("SELECT id, client, amount_cents FROM payments ORDER BY id")
            .fetch_all(&pool)
            .await?;
    println!("\npayments in the database: {rows:?}");
    println!("emails sent: {}", emails_sent.load(Ordering::SeqCst));
    assert_eq!(rows.len(), 3, "alice's order-1 and order-2, bob's order-1");
    assert_eq!(
        emails_sent.load(Ordering::SeqCst),
        2,
        "receipt-1 and receipt-2"
    );
    Ok(())
}
