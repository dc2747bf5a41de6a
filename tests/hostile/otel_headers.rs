//! Hostile `traceparent` / `tracestate` headers (feature `otel`) on HTTP requests and on
//! outgoing messages: never a panic, never a failed request; a message's own traceparent kept.

use std::sync::OnceLock;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use idempotent::Inbox;
use idempotent::http::{IdempotencyLayer, IdempotentTx};
use idempotent::outbox::{Destination, Outbox, OutgoingMessage};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

fn install() {
    static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();
    PROVIDER.get_or_init(|| {
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(InMemorySpanExporter::default())
            .build();
        tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("adv")))
            .init();
        provider
    });
}

async fn handler(mut tx: IdempotentTx<sqlx::Sqlite>) -> StatusCode {
    sqlx::query("SELECT 1")
        .execute(tx.connection())
        .await
        .unwrap();
    StatusCode::CREATED
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_huge_trace_headers_never_fail_a_request() {
    install();
    let inbox = Inbox::in_memory().await.unwrap();
    let layer = IdempotencyLayer::transactional(inbox, |_| Some("c".into()));
    let router = Router::new().route("/", post(handler).layer(layer));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await });
    let valid = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let huge_state: String = (0..5000).map(|i| format!("k{i}=v{i},")).collect();
    let cases: Vec<(String, Option<String>)> = vec![
        ("".into(), None),
        ("garbage".into(), None),
        ("00-".into(), None),
        (
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
            None,
        ),
        (
            "00-00000000000000000000000000000000-b7ad6b7169203331-01".into(),
            None,
        ),
        (
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01".into(),
            None,
        ),
        (
            "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01".into(),
            None,
        ),
        (
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra-fields".into(),
            None,
        ),
        (
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-zz".into(),
            None,
        ),
        ("00-é€-b7ad6b7169203331-01".into(), None),
        ("0".repeat(60_000), None),
        (valid.into(), Some(huge_state.clone())),
        (valid.into(), Some("=,=,,,=x=y=z".into())),
        (valid.into(), Some("é=€".into())),
        ("-".repeat(55), Some("a".repeat(60_000))),
    ];
    let http = reqwest::Client::new();
    for (i, (parent, state)) in cases.iter().enumerate() {
        let mut request = http
            .post(&url)
            .header("Idempotency-Key", format!("k{i}"))
            .header("traceparent", parent.as_bytes());
        if let Some(state) = state {
            request = request.header("tracestate", state.as_bytes());
        }
        let answered = request.send().await;
        let status = answered.as_ref().map(|r| r.status().as_u16());
        assert!(
            matches!(status, Ok(201) | Ok(431)),
            "case {i} ({:.40}): {answered:?}",
            parent
        );
    }
    // Two traceparent headers at once.
    let answered = http
        .post(&url)
        .header("Idempotency-Key", "two")
        .header("traceparent", valid)
        .header("traceparent", "garbage")
        .send()
        .await
        .unwrap();
    assert_eq!(answered.status().as_u16(), 201);
}

/// A message that carries its own `traceparent` (any case) keeps it, and gets no second one; a
/// message with only a `tracestate` gets no second `tracestate`.
#[tokio::test]
async fn a_message_with_its_own_trace_context_keeps_it() {
    install();
    let span = tracing::info_span!("sender");
    let _entered = span.enter();
    let mut outbox = Outbox::new("adv", "k").unwrap();
    let mine = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    outbox.send(
        OutgoingMessage::new(Destination::queue("q"), b"x".to_vec())
            .with_header("TraceParent", mine),
    );
    outbox.send(
        OutgoingMessage::new(Destination::queue("q"), b"y".to_vec())
            .with_header("tracestate", "a=b"),
    );
    let inbox = Inbox::in_memory().await.unwrap();
    let mut tx = inbox.pool().begin().await.unwrap();
    inbox.enqueue(&mut tx, outbox).await.unwrap();
    tx.commit().await.unwrap();
    let rows: Vec<Vec<u8>> =
        sqlx::query_scalar("SELECT headers FROM idempotent_inbox_outbox ORDER BY id")
            .fetch_all(inbox.pool())
            .await
            .unwrap();
    let first = String::from_utf8_lossy(&rows[0]).to_lowercase();
    let second = String::from_utf8_lossy(&rows[1]).to_lowercase();
    eprintln!("{first}\n{second}");
    assert_eq!(first.matches("traceparent").count(), 1, "{first}");
    assert!(first.contains(mine), "{first}");
    assert!(
        second.matches("tracestate").count() <= 1,
        "two tracestates: {second}"
    );
}
