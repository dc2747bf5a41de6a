//! One trace across hops (feature `otel`), for real: a client's request with a W3C
//! `traceparent` → the HTTP layer → handler A, which commits an order and queues a message in its
//! outbox (PostgreSQL) → the relay → RabbitMQ, and NATS JetStream → the runner → handler B. Every
//! span goes to an in-memory exporter through `tracing-opentelemetry`, and the test checks the
//! chain: the request's span is the client's child, the delivery's span is the child of the span
//! that queued the message (the request's), and handler B's span is the delivery's child, all in
//! the client's trace. Handler B panics on its first attempt, so the message is delivered again:
//! the second delivery is in the same trace, under the same parent.
#![cfg(all(
    feature = "otel",
    feature = "http",
    feature = "postgres",
    feature = "rabbitmq",
    feature = "nats"
))]

#[path = "../support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use idempotent::broker::{BrokerError, Message, RetryPolicy, RunnerStats, Shutdown};
use idempotent::http::{IdempotencyLayer, IdempotentTx, RequestKey};
use idempotent::outbox::{Destination, OutgoingMessage, Publisher, RelayOptions};
use idempotent::{Error, Handled, Inbox, idempotent};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use sqlx::{PgConnection, Postgres};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use support::postgres::PgHarness;

/// Every span of the process, exported as it ends.
fn exporter() -> &'static InMemorySpanExporter {
    static EXPORTER: OnceLock<(InMemorySpanExporter, SdkTracerProvider)> = OnceLock::new();
    let (exporter, _provider) = EXPORTER.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let tracer = provider.tracer("idempotent-otel-test");
        tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(tracer))
            .init();
        (exporter, provider)
    });
    exporter
}

/// The spans of `trace`, by name (several per name: a redelivered message has two deliveries).
fn spans_of(trace: TraceId) -> HashMap<String, Vec<SpanData>> {
    let mut spans: HashMap<String, Vec<SpanData>> = HashMap::new();
    for span in exporter().get_finished_spans().unwrap() {
        if span.span_context.trace_id() == trace {
            spans.entry(span.name.to_string()).or_default().push(span);
        }
    }
    spans
}

/// Handler A's app: the inbox of its database, and where its message goes.
#[derive(Clone)]
struct ShopA {
    destination: Destination,
}

/// Handler A: records the order and queues `order.placed` in the outbox, in the claimed
/// transaction.
async fn place_order(
    axum::extract::State(shop): axum::extract::State<ShopA>,
    key: RequestKey,
    mut tx: IdempotentTx<Postgres>,
) -> StatusCode {
    sqlx::query("INSERT INTO orders (id) VALUES ($1)")
        .bind(key.key())
        .execute(tx.connection())
        .await
        .unwrap();
    let placed = OutgoingMessage::new(shop.destination.clone(), key.key().as_bytes().to_vec());
    tx.claimed_mut().outbox().send(placed);
    StatusCode::CREATED
}

struct Placed {
    message_id: String,
}

/// Handler B: records the order's arrival, once per message.
#[idempotent(key = "message_id", consumer = "shipping")]
async fn on_placed(tx: &mut PgConnection, msg: &Placed) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO shipments (message_id) VALUES ($1)")
        .bind(&msg.message_id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// A worker of B's runner.
type Worker = Box<
    dyn FnMut(
            Message,
        )
            -> futures::future::BoxFuture<'static, Result<Handled<()>, Error<sqlx::Error>>>
        + Send,
>;

/// Handler B's worker: a span of its own (the delivery's child), and a panic on the first
/// attempt of each message, so that it is delivered again.
fn worker(inbox: &Inbox<Postgres>, attempts: &Arc<Mutex<Vec<u32>>>) -> Worker {
    let (inbox, attempts) = (inbox.clone(), attempts.clone());
    Box::new(move |message: Message| {
        let (inbox, attempts) = (inbox.clone(), attempts.clone());
        Box::pin(async move {
            let span = tracing::info_span!("handler_b", attempt = message.attempt);
            let _entered = span.enter();
            attempts.lock().unwrap().push(message.attempt);
            if message.attempt == 1 {
                panic!("handler B crashes on its first attempt");
            }
            let placed = Placed {
                message_id: message.message_id.0,
            };
            drop(_entered);
            tracing::Instrument::instrument(on_placed(&inbox, &placed), span).await
        })
    })
}

/// The two databases, A's HTTP server and its relay on `publisher`; returns what the caller
/// needs to send the request and run B.
struct Hops {
    _a: PgHarness,
    b: PgHarness,
    url: String,
    shutdown_relay: Shutdown,
}

impl Hops {
    async fn start(destination: Destination, publisher: impl Publisher) -> Self {
        let (a, b) = (PgHarness::new().await, PgHarness::new().await);
        sqlx::query("CREATE TABLE orders (id TEXT PRIMARY KEY)")
            .execute(&a.pool)
            .await
            .unwrap();
        sqlx::query("CREATE TABLE shipments (message_id TEXT PRIMARY KEY)")
            .execute(&b.pool)
            .await
            .unwrap();
        let client = |parts: &axum::http::request::Parts| {
            parts
                .headers
                .get("x-client")
                .and_then(|value| value.to_str().ok())
                .map(str::to_owned)
        };
        let layer = IdempotencyLayer::transactional(a.inbox.clone(), client);
        let app = Router::new()
            .route("/orders", post(place_order).layer(layer))
            .with_state(ShopA { destination });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/orders", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        let shutdown_relay = Shutdown::new();
        let relay = a.inbox.spawn_relay(
            publisher,
            RelayOptions::default()
                .poll_interval(Duration::from_millis(5), Duration::from_millis(50)),
        );
        let stop = shutdown_relay.clone();
        tokio::spawn(async move {
            stop.cancelled().await;
            relay.shutdown().await
        });
        Self {
            _a: a,
            b,
            url,
            shutdown_relay,
        }
    }

    /// Sends the order under a client span of the test's: its trace, and the span's id.
    async fn order(&self, key: &str) -> (TraceId, SpanId) {
        let client_span = tracing::info_span!("client");
        let context = client_span.context();
        let mut headers = HashMap::new();
        TraceContextPropagator::new().inject_context(&context, &mut headers);
        let ids = {
            use opentelemetry::trace::TraceContextExt;
            let span = context.span();
            (
                span.span_context().trace_id(),
                span.span_context().span_id(),
            )
        };
        let mut request = reqwest::Client::new()
            .post(&self.url)
            .header("Idempotency-Key", key)
            .header("x-client", "test");
        for (name, value) in headers {
            request = request.header(name, value);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 201);
        drop(client_span);
        ids
    }

    /// B's workers for a runner, and the attempts their handler saw.
    fn workers(
        &self,
    ) -> (
        impl FnMut() -> Worker + Send + 'static,
        Arc<Mutex<Vec<u32>>>,
    ) {
        let (inbox, attempts) = (self.b.inbox.clone(), Arc::default());
        let seen = Arc::clone(&attempts);
        (move || worker(&inbox, &seen), attempts)
    }

    /// Waits until B has recorded the message, then stops B's runner and A's relay; the handler
    /// must have seen the message twice (its first attempt panicked).
    async fn until_shipped(
        &self,
        shutdown: Shutdown,
        running: tokio::task::JoinHandle<Result<RunnerStats, BrokerError>>,
        attempts: Arc<Mutex<Vec<u32>>>,
    ) {
        self.until_recorded().await;
        shutdown.cancel();
        running.await.unwrap().unwrap();
        self.shutdown_relay.cancel();
        assert_eq!(*attempts.lock().unwrap(), [1, 2]);
    }

    /// Waits until B has recorded the message.
    async fn until_recorded(&self) {
        let start = Instant::now();
        loop {
            let shipped: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM shipments")
                .fetch_one(&self.b.pool)
                .await
                .unwrap();
            if shipped == 1 {
                return;
            }
            assert!(start.elapsed() < Duration::from_secs(60), "not shipped");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Checks the parent chain of the trace begun by the client span `client`: the request's span
/// under it, two deliveries (the first, whose handler panicked, and the redelivery) under the
/// request's span, and handler B's span under each delivery.
fn assert_one_trace(trace: TraceId, client: SpanId) {
    let start = Instant::now();
    let spans = loop {
        // The spans end as the tasks that hold them finish: wait for the last.
        let spans = spans_of(trace);
        let deliveries = spans.get("delivery").map_or(0, Vec::len);
        let handlers = spans.get("handler_b").map_or(0, Vec::len);
        if deliveries == 2 && handlers == 2 {
            break spans;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the trace has {deliveries} delivery and {handlers} handler spans: {:?}",
            spans.keys().collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let http = &spans["idempotent_http"];
    assert_eq!(http.len(), 1, "{http:?}");
    let http = &http[0];
    assert_eq!(
        http.parent_span_id, client,
        "the request's span is the client's child"
    );
    let mut attempts = Vec::new();
    for delivery in &spans["delivery"] {
        assert_eq!(
            delivery.parent_span_id,
            http.span_context.span_id(),
            "a delivery's span is the child of the span that queued the message"
        );
        let attempt = delivery
            .attributes
            .iter()
            .find(|kv| kv.key.as_str() == "attempt")
            .map(|kv| kv.value.to_string());
        attempts.push(attempt);
        let handlers: Vec<_> = spans["handler_b"]
            .iter()
            .filter(|h| h.parent_span_id == delivery.span_context.span_id())
            .collect();
        assert_eq!(
            handlers.len(),
            1,
            "handler B's span is its delivery's child"
        );
    }
    attempts.sort();
    assert_eq!(attempts, [Some("1".into()), Some("2".into())]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_from_an_http_request_through_the_outbox_and_rabbitmq_to_the_consumer() {
    exporter();
    let url = std::env::var("IDEMPOTENT_AMQP_URL").expect("IDEMPOTENT_AMQP_URL: run scripts/test");
    let (connection, channel) = {
        use lapin::{Connection, ConnectionProperties};
        let connection = Connection::connect(&url, ConnectionProperties::default())
            .await
            .unwrap();
        let channel = connection.create_channel().await.unwrap();
        (connection, channel)
    };
    let queue = format!("traced-{}", uuid::Uuid::new_v4().simple());
    channel
        .queue_declare(
            queue.as_str().into(),
            lapin::options::QueueDeclareOptions::durable(),
            Default::default(),
        )
        .await
        .unwrap();
    let publisher = idempotent::broker::rabbitmq::OutboxPublisher::connect(&url)
        .await
        .unwrap();
    let hops = Hops::start(Destination::queue(queue.clone()), publisher).await;
    let (trace, client) = hops.order("order-1").await;

    let (workers, attempts) = hops.workers();
    let shutdown = Shutdown::new();
    let runner = idempotent::broker::rabbitmq::Runner::connect(url, queue.as_str())
        .retry(RetryPolicy::new(3, Duration::from_millis(50)))
        .shutdown_on(shutdown.clone());
    let running = tokio::spawn(runner.run(workers));
    hops.until_shipped(shutdown, running, attempts).await;
    assert_one_trace(trace, client);
    drop((channel, connection));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_from_an_http_request_through_the_outbox_and_jetstream_to_the_consumer() {
    use idempotent::broker::nats::async_nats::{self, jetstream};
    exporter();
    let url = std::env::var("IDEMPOTENT_NATS_URL").expect("IDEMPOTENT_NATS_URL: run scripts/test");
    let context = jetstream::new(async_nats::connect(url).await.unwrap());
    let id = uuid::Uuid::new_v4().simple().to_string();
    let stream = context
        .create_stream(jetstream::stream::Config {
            name: format!("T_{id}"),
            subjects: vec![format!("{id}.placed"), format!("{id}.dead")],
            ..Default::default()
        })
        .await
        .unwrap();
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("shipping".into()),
            filter_subject: format!("{id}.placed"),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .unwrap();
    let publisher = idempotent::broker::nats::OutboxPublisher::new(context.clone());
    let hops = Hops::start(Destination::subject(format!("{id}.placed")), publisher).await;
    let (trace, client) = hops.order("order-1").await;

    let (workers, attempts) = hops.workers();
    let shutdown = Shutdown::new();
    let runner = idempotent::broker::nats::Runner::new(context, consumer, format!("{id}.dead"))
        .retry(RetryPolicy::new(3, Duration::from_millis(50)))
        .shutdown_on(shutdown.clone());
    let running = tokio::spawn(runner.run(workers));
    hops.until_shipped(shutdown, running, attempts).await;
    assert_one_trace(trace, client);
}
