//! Hostile tests of the multi-tenant support (`Inbox::with_schema`, `Tenants`, the tenants'
//! relay) on PostgreSQL and MariaDB, from the public API only. Each PostgreSQL test gives its pool
//! a `search_path` to a "home" schema that has every table a tenant has (the inbox's, `effects`):
//! nothing may land there.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use idempotent::http::{IdempotencyLayer, IdempotentTx, REPLAYED};
use idempotent::outbox::{Destination, Outbox, OutgoingMessage, Publication, RelayOptions};
use idempotent::testing::RecordingPublisher;
use idempotent::{Inbox, InboxError, Tenants, message_key};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, MySql, Postgres};

#[path = "../support/mod.rs"]
mod support;

use support::CREATE_EFFECTS;
use support::postgres::create_schema_with_effects as create_schema;

fn pg_options() -> PgConnectOptions {
    std::env::var("IDEMPOTENT_PG_URL")
        .expect("IDEMPOTENT_PG_URL is not set")
        .parse()
        .unwrap()
}

fn id() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}

/// The test's own client.
async fn admin() -> PgPool {
    PgPoolOptions::new()
        .max_connections(3)
        .connect_with(pg_options())
        .await
        .unwrap()
}

/// A home schema (migrated, with `effects`), tenants' schemas (with `effects`, not migrated), and
/// a pool of `connections` whose `search_path` is the home schema.
struct Setup {
    admin: PgPool,
    pool: PgPool,
    home: String,
    names: Vec<String>,
}

impl Setup {
    async fn new(tenants: usize, connections: u32) -> Self {
        let id = id();
        let admin = admin().await;
        let home = format!("home_{id}");
        let names: Vec<String> = (0..tenants).map(|n| format!("t{n:02}_{id}")).collect();
        for schema in names.iter().chain([&home]) {
            create_schema(&admin, schema).await;
        }
        let pool = PgPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(Duration::from_secs(20))
            .connect_lazy_with(pg_options().options([("search_path", home.as_str())]));
        Inbox::new(pool.clone()).migrate().await.unwrap();
        Self {
            admin,
            pool,
            home,
            names,
        }
    }

    fn tenants(&self, inbox: &Inbox<Postgres>) -> Tenants<Postgres> {
        Tenants::by_schema(inbox, self.names.iter().map(String::as_str)).unwrap()
    }

    async fn count(&self, table: &str) -> i64 {
        count(&self.admin, table).await
    }

    /// Nothing in the home schema's tables.
    async fn assert_home_untouched(&self) {
        let h = &self.home;
        for table in [
            format!("{h}.effects"),
            format!("{h}.idempotent_inbox"),
            format!("{h}.idempotent_inbox_calls"),
            format!("{h}.idempotent_inbox_outbox"),
            format!("{h}.idempotent_inbox_audit"),
        ] {
            assert_eq!(self.count(&table).await, 0, "{table}: a tenant wrote here");
        }
    }
}

async fn count(admin: &PgPool, table: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) FROM {table}")))
        .fetch_one(admin)
        .await
        .unwrap()
}

async fn labels(admin: &PgPool, schema: &str) -> Vec<String> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT label FROM {schema}.effects ORDER BY label"
    )))
    .fetch_all(admin)
    .await
    .unwrap()
}

/// Claims `key` on `inbox` and, if new, writes the effect `label` (unqualified) and one outgoing
/// message (`payload`, ordering key `ordering`) in the claim's transaction. `true`: it was new.
async fn handle(
    inbox: &Inbox<Postgres>,
    key: &str,
    label: &str,
    payload: &str,
    ordering: Option<&str>,
) -> Result<bool, InboxError> {
    let Some(mut claimed) = inbox.claim("orders", key).await? else {
        return Ok(false);
    };
    sqlx::query("INSERT INTO effects (consumer, label) VALUES ('orders', $1)")
        .bind(label)
        .execute(claimed.connection())
        .await
        .unwrap();
    let mut message =
        OutgoingMessage::new(Destination::exchange("x", "r"), payload.as_bytes().to_vec());
    if let Some(ordering) = ordering {
        message = message.with_ordering_key(ordering);
    }
    claimed.outbox().send(message);
    claimed.commit().await?;
    Ok(true)
}

/// Waits until `done` holds (checked every 20 ms), at most `limit`; whether it did.
async fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if done() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn payloads(publisher: &RecordingPublisher) -> Vec<String> {
    publisher
        .published()
        .iter()
        .map(|p: &Publication| String::from_utf8(p.payload.clone()).unwrap())
        .collect()
}

fn fast_relay() -> RelayOptions {
    RelayOptions::default()
        .batch_size(4)
        .poll_interval(Duration::from_millis(5), Duration::from_millis(50))
}

// ---------------------------------------------------------------------------------------------
// 1. The HTTP layer on a tenant's inbox.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_routes_of_two_tenants_write_store_and_replay_in_their_own_schemas() {
    use axum::Router;
    use axum::http::StatusCode;
    use axum::routing::post;

    let s = Setup::new(2, 2).await;
    let tenants = s.tenants(&Inbox::new(s.pool.clone()));
    tenants.migrate().await.unwrap();
    async fn pay(mut tx: IdempotentTx<Postgres>, body: String) -> (StatusCode, String) {
        sqlx::query("INSERT INTO effects (consumer, label) VALUES ('http', $1)")
            .bind(&body)
            .execute(tx.connection())
            .await
            .unwrap();
        let path: String = sqlx::query_scalar("SELECT current_setting('search_path')")
            .fetch_one(tx.connection())
            .await
            .unwrap();
        tx.claimed_mut().outbox().send(OutgoingMessage::new(
            Destination::queue("q"),
            body.clone().into_bytes(),
        ));
        (StatusCode::CREATED, format!("{body} in {path}"))
    }
    async fn email(body: String) -> (StatusCode, String) {
        (StatusCode::OK, format!("sent {body}"))
    }
    let mut router = Router::new();
    for name in &s.names {
        let inbox = tenants.inbox(name).unwrap().clone();
        let scope = |_: &axum::http::request::Parts| Some("client".to_owned());
        router = router
            .route(
                &format!("/{name}/pay"),
                post(pay).layer(IdempotencyLayer::transactional(inbox.clone(), scope)),
            )
            .route(
                &format!("/{name}/email"),
                post(email).layer(
                    IdempotencyLayer::leased(inbox, scope, Duration::from_secs(30)).unwrap(),
                ),
            );
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let client = reqwest::Client::new();
    let send = async |path: String, key: &str, body: &str| {
        let response = client
            .post(format!("http://{addr}{path}"))
            .header("idempotency-key", key)
            .body(body.to_owned())
            .send()
            .await
            .unwrap();
        let replayed = response.headers().get(REPLAYED).is_some();
        let status = response.status().as_u16();
        (status, replayed, response.text().await.unwrap())
    };
    for name in &s.names {
        // The same key in each tenant: each runs its handler once.
        let first = send(format!("/{name}/pay"), "key-1", name).await;
        assert_eq!(first.0, 201, "{first:?}");
        assert!(
            !first.1,
            "{name}: the first request was a replay: {first:?}"
        );
        assert!(
            first.2.ends_with(&format!("in {name}"))
                || first.2.ends_with(&format!("in \"{name}\"")),
            "{name}: the handler's search_path: {first:?}"
        );
        let again = send(format!("/{name}/pay"), "key-1", name).await;
        assert_eq!((again.0, again.1), (201, true), "{name}: {again:?}");
        assert_eq!(again.2, first.2, "{name}: the stored response");
        let emailed = send(format!("/{name}/email"), "key-2", name).await;
        let twice = send(format!("/{name}/email"), "key-2", name).await;
        assert_eq!((emailed.0, emailed.1), (200, false), "{emailed:?}");
        assert_eq!((twice.0, twice.1), (200, true), "{twice:?}");
    }
    for name in &s.names {
        assert_eq!(
            labels(&s.admin, name).await,
            std::slice::from_ref(name),
            "{name}"
        );
        // key-1 (transactional) and key-2 (leased).
        assert_eq!(s.count(&format!("{name}.idempotent_inbox")).await, 2);
        assert_eq!(s.count(&format!("{name}.idempotent_inbox_outbox")).await, 1);
    }
    s.assert_home_untouched().await;
    server.abort();
}

/// One transactional layer and one leased layer serve four tenants, each request on the inbox of
/// the tenant its `x-tenant` header names. The same key sent at once for every tenant, five
/// times each: one run per tenant (its effect in its own schema, its replays its own), the others
/// `409` or the replay. No tenant, an empty one or a tenant not served: `400` with its code,
/// nothing written anywhere. The purger the layer hands out purges every tenant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_layer_serves_each_request_on_its_tenants_inbox() {
    use axum::Router;
    use axum::http::StatusCode;
    use axum::routing::post;

    let s = Setup::new(4, 4).await;
    let tenants = s.tenants(&Inbox::new(s.pool.clone()));
    tenants.migrate().await.unwrap();
    async fn pay(mut tx: IdempotentTx<Postgres>, body: String) -> (StatusCode, String) {
        // Slow enough that the twins meet the first in flight.
        tokio::time::sleep(Duration::from_millis(150)).await;
        sqlx::query("INSERT INTO effects (consumer, label) VALUES ('http', $1)")
            .bind(&body)
            .execute(tx.connection())
            .await
            .unwrap();
        let path: String = sqlx::query_scalar("SELECT current_setting('search_path')")
            .fetch_one(tx.connection())
            .await
            .unwrap();
        (StatusCode::CREATED, format!("{body} in {path}"))
    }
    let runs = std::sync::Arc::new(std::sync::Mutex::new(HashMap::<String, usize>::new()));
    let header = |parts: &axum::http::request::Parts, name: &str| {
        parts.headers.get(name)?.to_str().ok().map(str::to_owned)
    };
    let scope = |_: &axum::http::request::Parts| Some("client".to_owned());
    let transactional = IdempotencyLayer::transactional(Inbox::new(s.pool.clone()), scope)
        .by_tenant(tenants.clone(), move |parts| header(parts, "x-tenant"));
    let leased =
        IdempotencyLayer::leased(Inbox::new(s.pool.clone()), scope, Duration::from_secs(30))
            .unwrap()
            .consumer("http-leased")
            .unwrap()
            .by_tenant(tenants.clone(), move |parts| header(parts, "x-tenant"));
    let counted = runs.clone();
    let email = move |body: String| {
        let runs = counted.clone();
        async move {
            *runs.lock().unwrap().entry(body.clone()).or_default() += 1;
            (StatusCode::OK, format!("sent {body}"))
        }
    };
    let router = Router::new()
        .route("/pay", post(pay).layer(transactional.clone()))
        .route("/email", post(email).layer(leased));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let client = reqwest::Client::new();
    let send = async |path: &str, tenant: Option<&str>, key: &str, body: &str| {
        let mut request = client
            .post(format!("http://{addr}{path}"))
            .header("idempotency-key", key)
            .body(body.to_owned());
        if let Some(tenant) = tenant {
            request = request.header("x-tenant", tenant);
        }
        let response = request.send().await.unwrap();
        let replayed = response.headers().get(REPLAYED).is_some();
        let status = response.status().as_u16();
        (status, replayed, response.text().await.unwrap())
    };
    // The same key for every tenant, five twins each, all at once.
    let twins = s.names.iter().flat_map(|name| {
        (0..5).map(move |_| async move { (name, send("/pay", Some(name), "same", name).await) })
    });
    let answers = futures::future::join_all(twins).await;
    for name in &s.names {
        let mine: Vec<_> = answers
            .iter()
            .filter(|(n, _)| *n == name)
            .map(|(_, a)| a)
            .collect();
        let ran: Vec<_> = mine.iter().filter(|a| a.0 == 201 && !a.1).collect();
        assert_eq!(ran.len(), 1, "{name}: one run: {mine:?}");
        assert!(
            ran[0].2.ends_with(&format!("in {name}"))
                || ran[0].2.ends_with(&format!("in \"{name}\"")),
            "{name}: the handler's search_path: {mine:?}"
        );
        for answer in &mine {
            match answer.0 {
                201 => assert_eq!(
                    answer.2, ran[0].2,
                    "{name}: a replay of another's: {mine:?}"
                ),
                409 => assert!(answer.2.contains("idempotency_key_in_use"), "{answer:?}"),
                _ => panic!("{name}: {mine:?}"),
            }
        }
        let again = send("/pay", Some(name), "same", name).await;
        assert_eq!(
            (again.0, again.1, &again.2),
            (201, true, &ran[0].2),
            "{name}"
        );
        // The leased route's handler runs once per tenant too.
        let first = send("/email", Some(name), "mail", name).await;
        let second = send("/email", Some(name), "mail", name).await;
        assert_eq!(
            (first.0, first.1, second.0, second.1),
            (200, false, 200, true),
            "{name}"
        );
    }
    for name in &s.names {
        assert_eq!(runs.lock().unwrap()[name], 1, "{name}: leased runs");
        assert_eq!(
            labels(&s.admin, name).await,
            std::slice::from_ref(name),
            "{name}"
        );
        assert_eq!(
            s.count(&format!("{name}.idempotent_inbox")).await,
            2,
            "{name}"
        );
    }
    // Requests no tenant of this layer's: refused before anything is written.
    for (tenant, code) in [
        (None, "tenant_missing"),
        (Some(""), "tenant_missing"),
        (Some("nobody"), "tenant_unknown"),
        (Some(s.home.as_str()), "tenant_unknown"),
    ] {
        let refused = send("/pay", tenant, "other", "x").await;
        assert_eq!(refused.0, 400, "{tenant:?}: {refused:?}");
        assert!(refused.2.contains(code), "{tenant:?}: {refused:?}");
    }
    for name in &s.names {
        assert_eq!(
            s.count(&format!("{name}.idempotent_inbox")).await,
            2,
            "{name}"
        );
    }
    s.assert_home_untouched().await;
    // The layer's tenants keep its rows for its retention: a purge after it removes them all.
    let layer = transactional.retention(Duration::from_millis(1));
    let served = layer.tenants().expect("the layer serves tenants");
    assert_eq!(served.len(), s.names.len());
    tokio::time::sleep(Duration::from_millis(20)).await;
    for (name, inbox) in served.iter() {
        let purged = inbox.purge_expired(500).await.unwrap();
        assert!(purged.deleted >= 1, "{name}: {purged:?}");
        assert_eq!(
            s.count(&format!("{name}.idempotent_inbox")).await,
            1,
            "{name}: the leased row stays"
        );
    }
    server.abort();
}

// ---------------------------------------------------------------------------------------------
// 2. Batch claims and calls in a tenant's schema.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_claims_and_calls_stay_in_their_tenant() {
    let s = Setup::new(2, 2).await;
    let tenants = s.tenants(&Inbox::new(s.pool.clone()));
    tenants.migrate().await.unwrap();
    let keys: Vec<_> = (0..5)
        .map(|n| message_key(&format!("k{n}")).unwrap())
        .collect();
    for name in &s.names {
        let inbox = tenants.inbox(name).unwrap();
        for round in 0..2 {
            let mut batch = inbox.claim_batch("batch", &keys).await.unwrap();
            for (n, _) in keys.iter().enumerate() {
                if batch.is_new(n) {
                    assert_eq!(round, 0, "{name}: k{n} new again");
                    sqlx::query("INSERT INTO effects (consumer, label) VALUES ('batch', $1)")
                        .bind(format!("k{n}"))
                        .execute(batch.connection())
                        .await
                        .unwrap();
                } else {
                    assert_eq!(round, 1, "{name}: k{n} a duplicate on its first batch");
                }
            }
            batch.commit().await.unwrap();
        }
        let key = message_key("call-key").unwrap();
        for attempt in 0..2 {
            let result: String = inbox
                .call_once(
                    "calls",
                    &key,
                    "charge",
                    Duration::from_secs(30),
                    async |_| Ok::<_, std::io::Error>(format!("{name}:{attempt}")),
                )
                .await
                .unwrap();
            assert_eq!(result, format!("{name}:0"), "{name}: the stored result");
        }
    }
    for name in &s.names {
        assert_eq!(s.count(&format!("{name}.effects")).await, 5, "{name}");
        assert_eq!(s.count(&format!("{name}.idempotent_inbox")).await, 5);
        assert_eq!(s.count(&format!("{name}.idempotent_inbox_calls")).await, 1);
    }
    s.assert_home_untouched().await;
}

// ---------------------------------------------------------------------------------------------
// 3. Purges and the operators' reads of two tenants.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_lock_and_operations_are_per_tenant() {
    let s = Setup::new(2, 4).await;
    let base = Inbox::new(s.pool.clone()).with_retention(Duration::ZERO);
    let tenants = s.tenants(&base);
    tenants.migrate().await.unwrap();
    let (a, b) = (&s.names[0], &s.names[1]);
    let (ia, ib) = (tenants.inbox(a).unwrap(), tenants.inbox(b).unwrap());
    for n in 0..3 {
        assert!(handle(ia, &format!("a{n}"), "a", "pa", None).await.unwrap());
    }
    assert!(handle(ib, "b0", "b", "pb", None).await.unwrap());

    // Only tenant a's lock held elsewhere: b purges, a reports the lock held.
    let mut holder = s.admin.acquire().await.unwrap();
    let locked: bool =
        sqlx::query_scalar("SELECT pg_try_advisory_lock(1768453, to_regclass($1)::oid::int)")
            .bind(format!("\"{a}\".\"idempotent_inbox\""))
            .fetch_one(&mut *holder)
            .await
            .unwrap();
    assert!(locked);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let (ra, rb) = tokio::join!(ia.purge_expired(100), ib.purge_expired(100));
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert!(ra.locked_elsewhere, "a's purge ignored its lock: {ra:?}");
    assert!(!rb.locked_elsewhere, "b's purge saw a's lock: {rb:?}");
    assert_eq!(rb.deleted, 1, "{rb:?}");
    sqlx::query("SELECT pg_advisory_unlock_all()")
        .execute(&mut *holder)
        .await
        .unwrap();
    drop(holder);

    // Both at once, many times: neither sees the other's lock.
    for n in 0..5 {
        handle(ia, &format!("again-a{n}"), "a", "pa", None)
            .await
            .unwrap();
        handle(ib, &format!("again-b{n}"), "b", "pb", None)
            .await
            .unwrap();
        let (ra, rb) = tokio::join!(ia.purge_expired(1), ib.purge_expired(1));
        let (ra, rb) = (ra.unwrap(), rb.unwrap());
        assert!(
            !ra.locked_elsewhere && !rb.locked_elsewhere,
            "{ra:?} {rb:?}"
        );
    }
    assert_eq!(s.count(&format!("{a}.idempotent_inbox")).await, 0);
    assert_eq!(s.count(&format!("{b}.idempotent_inbox")).await, 0);

    // Operations see their tenant only.
    handle(ia, "only-a", "a", "pa", None).await.unwrap();
    assert!(ia.inspect("orders", "only-a").await.unwrap().is_some());
    assert!(ib.inspect("orders", "only-a").await.unwrap().is_none());
    assert!(!ib.forget("orders", "only-a", "test").await.unwrap());
    let stats_b = ib.stats().await.unwrap();
    assert!(
        stats_b.iter().all(|c| c.rows == 0),
        "b's stats count a's rows: {stats_b:?}"
    );
    let stats_a = ia.stats().await.unwrap();
    assert_eq!(
        stats_a.iter().map(|c| c.rows).sum::<u64>(),
        1,
        "{stats_a:?}"
    );
    let (oa, ob) = (
        ia.outbox_stats().await.unwrap(),
        ib.outbox_stats().await.unwrap(),
    );
    // a wrote 3 + 5 + 1 messages, b 1 + 5, none published.
    assert_eq!((oa.pending, ob.pending), (9, 6), "{oa:?} {ob:?}");
    // A parked message in a: b neither sees nor skips it.
    let row: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "UPDATE {a}.idempotent_inbox_outbox SET state = 2 \
         WHERE id = (SELECT min(id) FROM {a}.idempotent_inbox_outbox) RETURNING id"
    )))
    .fetch_one(&s.admin)
    .await
    .unwrap();
    assert_eq!(ia.outbox_stats().await.unwrap().parked, 1);
    assert_eq!(ib.outbox_stats().await.unwrap().parked, 0);
    assert!(ib.held_keys(None, 10).await.unwrap().is_empty());
    assert!(!ib.skip_parked(row).await.unwrap(), "b skipped a's message");
    assert!(
        !ib.retry_parked(row).await.unwrap(),
        "b retried a's message"
    );
    assert!(ia.retry_parked(row).await.unwrap());
    assert!(ia.forget("orders", "only-a", "test").await.unwrap());
    s.assert_home_untouched().await;
}

// ---------------------------------------------------------------------------------------------
// 4. A tenant's schema missing or dropped while the tenants' relay runs.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_tenant_schema_stalls_no_other_tenant() {
    let s = Setup::new(3, 6).await;
    let tenants = s.tenants(&Inbox::new(s.pool.clone()));
    tenants.migrate().await.unwrap();
    let publisher = RecordingPublisher::new();
    let relay = tenants.spawn_relay(publisher.clone(), fast_relay());
    for name in &s.names {
        let inbox = tenants.inbox(name).unwrap();
        handle(inbox, "before", name, &format!("{name}:before"), None)
            .await
            .unwrap();
    }
    assert!(
        wait_until(Duration::from_secs(10), || publisher.published().len() >= 3).await,
        "{:?}",
        payloads(&publisher)
    );
    let dropped = &s.names[1];
    sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {dropped} CASCADE")))
        .execute(&s.admin)
        .await
        .unwrap();
    // A claim there is an error, not a panic; migrate names the tenant.
    let Err(error) = tenants.inbox(dropped).unwrap().claim("orders", "x").await else {
        panic!("a claim in a dropped schema succeeded");
    };
    eprintln!(
        "claim in a dropped schema: {error} (retryable: {})",
        error.is_retryable()
    );
    let failed = tenants
        .migrate()
        .await
        .expect_err("migrate of a dropped schema");
    assert_eq!(&failed.tenant, dropped);
    eprintln!("migrate: {failed}");
    for n in 0..10 {
        for name in [&s.names[0], &s.names[2]] {
            let inbox = tenants.inbox(name).unwrap();
            handle(
                inbox,
                &format!("after{n}"),
                name,
                &format!("{name}:after{n}"),
                None,
            )
            .await
            .unwrap();
        }
    }
    let flowed = wait_until(Duration::from_secs(10), || {
        publisher.published().len() >= 23
    })
    .await;
    let stats = relay.shutdown().await;
    assert!(flowed, "stalled: {stats:?} {:?}", payloads(&publisher));
    let published = payloads(&publisher);
    let unique: HashSet<_> = published.iter().collect();
    assert_eq!(
        unique.len(),
        published.len(),
        "published twice: {published:?}"
    );
    assert!(
        stats.failed_batches > 0,
        "the dropped tenant never failed? {stats:?}"
    );
    s.assert_home_untouched().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_whose_schema_was_never_made_is_a_typed_error() {
    let s = Setup::new(1, 2).await;
    let ghost = format!("ghost_{}", id());
    let tenants = Tenants::by_schema(
        &Inbox::new(s.pool.clone()),
        [s.names[0].as_str(), ghost.as_str()],
    )
    .unwrap();
    let failed = tenants
        .migrate()
        .await
        .expect_err("migrate of a missing schema");
    assert_eq!(failed.tenant, ghost);
    let Err(error) = tenants.inbox(&ghost).unwrap().claim("orders", "k").await else {
        panic!("claimed in a missing schema");
    };
    eprintln!("claim in a missing schema: {error:?}");
    assert!(matches!(
        tenants.inbox("nobody"),
        Err(InboxError::UnknownTenant { .. })
    ));
    // The other tenant is fine, and a relay over both publishes its messages.
    let good = tenants.inbox(&s.names[0]).unwrap();
    good.migrate().await.unwrap();
    handle(good, "k", "good", "good", None).await.unwrap();
    let publisher = RecordingPublisher::new();
    let relay = tenants.spawn_relay(publisher.clone(), fast_relay());
    let ok = wait_until(Duration::from_secs(10), || publisher.published().len() == 1).await;
    relay.shutdown().await;
    assert!(ok, "the good tenant's message was not published");
    s.assert_home_untouched().await;
}

// ---------------------------------------------------------------------------------------------
// 5. One connection for twenty tenants, their handlers and their relay.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_serves_twenty_tenants_handlers_and_relay() {
    let s = Setup::new(20, 1).await;
    let tenants = s.tenants(&Inbox::new(s.pool.clone()).with_pipelined_claim());
    tenants.migrate().await.unwrap();
    let publisher = RecordingPublisher::new();
    let relay = tenants.spawn_relay(publisher.clone(), fast_relay().listen(false).workers(2));
    let work = async {
        let mut handlers = Vec::new();
        for (t, name) in s.names.iter().enumerate() {
            let inbox = tenants.inbox(name).unwrap().clone();
            let name = name.clone();
            handlers.push(tokio::spawn(async move {
                for n in 0..3 {
                    let key = format!("k{n}");
                    // Twice each: the second a duplicate.
                    for _ in 0..2 {
                        handle(&inbox, &key, &key, &format!("{t}:{n}"), None)
                            .await
                            .unwrap_or_else(|e| panic!("{name}: {e}"));
                    }
                }
            }));
        }
        for handler in handlers {
            handler.await.unwrap();
        }
    };
    let finished = tokio::time::timeout(Duration::from_secs(30), work).await;
    assert!(
        finished.is_ok(),
        "the handlers deadlocked on one connection"
    );
    let all = wait_until(Duration::from_secs(20), || {
        publisher.published().len() >= 60
    })
    .await;
    let stats = tokio::time::timeout(Duration::from_secs(10), relay.shutdown())
        .await
        .expect("the relay's shutdown hung");
    assert!(all, "{stats:?}: {}", publisher.published().len());
    assert_eq!(publisher.published().len(), 60, "{stats:?}");
    for name in &s.names {
        assert_eq!(s.count(&format!("{name}.effects")).await, 3, "{name}");
    }
    s.assert_home_untouched().await;
}

// ---------------------------------------------------------------------------------------------
// 6. Two tenants' relays racing over thirty tenants with ordering keys.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tenant_relays_race_over_thirty_tenants_keeping_key_order() {
    let s = Setup::new(30, 8).await;
    let tenants = s.tenants(&Inbox::new(s.pool.clone()));
    tenants.migrate().await.unwrap();
    const KEYS: usize = 2;
    const PER_KEY: usize = 6;
    let publisher = RecordingPublisher::new();
    let options = fast_relay().workers(2).batch_size(3);
    let one = tenants.spawn_relay(publisher.clone(), options.clone());
    let two = tenants.spawn_relay(publisher.clone(), options);
    for seq in 0..PER_KEY {
        for (t, name) in s.names.iter().enumerate() {
            let inbox = tenants.inbox(name).unwrap();
            for k in 0..KEYS {
                let payload = format!("{t}:{k}:{seq}");
                handle(inbox, &payload, "e", &payload, Some(&format!("key-{k}")))
                    .await
                    .unwrap();
            }
        }
    }
    let total = s.names.len() * KEYS * PER_KEY;
    let all = wait_until(Duration::from_secs(30), || {
        publisher.published().len() >= total
    })
    .await;
    let (a, b) = tokio::join!(one.shutdown(), two.shutdown());
    assert!(
        all,
        "{} of {total}: {a:?} {b:?}",
        publisher.published().len()
    );
    let published = payloads(&publisher);
    let mut seen: HashMap<(String, String), Vec<usize>> = HashMap::new();
    let mut twice = Vec::new();
    let mut unique = HashSet::new();
    for p in &published {
        if !unique.insert(p.clone()) {
            twice.push(p.clone());
        }
        let mut parts = p.split(':');
        let (t, k, seq) = (
            parts.next().unwrap().to_owned(),
            parts.next().unwrap().to_owned(),
            parts.next().unwrap().parse().unwrap(),
        );
        seen.entry((t, k)).or_default().push(seq);
    }
    assert!(
        twice.is_empty() || a.retried + b.retried > 0,
        "published twice without a failed batch: {twice:?}"
    );
    for ((t, k), seqs) in &seen {
        let mut sorted = seqs.clone();
        sorted.sort_unstable();
        assert_eq!(seqs, &sorted, "tenant {t} key {k} out of order");
    }
    // Each tenant's ids are its own: 30 tenants, the same keys, no id shared.
    let ids: HashSet<_> = publisher
        .published()
        .iter()
        .map(|p| p.message_id.clone())
        .collect();
    assert_eq!(ids.len(), total);
}

// ---------------------------------------------------------------------------------------------
// 7. A body that moves the search_path, deallocates, or uses savepoints, on one pooled
// connection that the next tenant's claim reuses.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_moving_the_search_path_misroutes_no_later_tenant() {
    let s = Setup::new(2, 1).await;
    let (a, b) = (s.names[0].clone(), s.names[1].clone());
    let plain = s.tenants(&Inbox::new(s.pool.clone()));
    let piped = s.tenants(&Inbox::new(s.pool.clone()).with_pipelined_claim());
    plain.migrate().await.unwrap();
    let home = s.home.clone();
    let statements = [
        format!("SET search_path TO {home}"),
        "SET search_path TO public".to_owned(),
        "RESET search_path".to_owned(),
        format!("SET SESSION search_path TO {b}"),
        format!("SELECT set_config('search_path', '{home}', false)"),
        "DEALLOCATE ALL".to_owned(),
    ];
    for (round, tenants) in [&plain, &piped].into_iter().enumerate() {
        let (ia, ib) = (tenants.inbox(&a).unwrap(), tenants.inbox(&b).unwrap());
        for (n, statement) in statements.iter().enumerate() {
            let key = format!("{round}-{n}");
            // a's body: its effect, then the hostile statement, then commit.
            let mut claimed = ia.claim("orders", &key).await.unwrap().unwrap();
            sqlx::query("INSERT INTO effects (consumer, label) VALUES ('orders', $1)")
                .bind(&key)
                .execute(claimed.connection())
                .await
                .unwrap();
            sqlx::raw_sql(AssertSqlSafe(statement.clone()))
                .execute(claimed.connection())
                .await
                .unwrap();
            claimed.commit().await.unwrap();
            // b's next claim on the same (only) connection: its effect in b, at the first try
            // (after a DEALLOCATE ALL too: the claim that finds its statement gone forgets
            // sqlx's cached statements, the body's among them).
            let mut done = false;
            for _attempt in 0..1 {
                let Some(mut claimed) = ib.claim("orders", &key).await.unwrap() else {
                    break;
                };
                let path: String = sqlx::query_scalar("SELECT current_setting('search_path')")
                    .persistent(false)
                    .fetch_one(claimed.connection())
                    .await
                    .unwrap();
                assert_eq!(path.trim_matches('"'), b, "after {statement:?}");
                let written =
                    sqlx::query("INSERT INTO effects (consumer, label) VALUES ('orders', $1)")
                        .bind(&key)
                        .execute(claimed.connection())
                        .await;
                match written {
                    Ok(_) => {
                        claimed.commit().await.unwrap();
                        done = true;
                        break;
                    }
                    Err(error) => {
                        eprintln!("after {statement:?}: b's body failed: {error}");
                        claimed.rollback().await;
                    }
                }
            }
            assert!(done, "after {statement:?}: b never processed {key}");
            // A duplicate now, in both tenants.
            assert!(ia.claim("orders", &key).await.unwrap().is_none());
            assert!(ib.claim("orders", &key).await.unwrap().is_none());
        }
        // A savepoint that moved the search_path, rolled back to: the body is in a again.
        let key = format!("{round}-savepoint");
        let mut claimed = ia.claim("orders", &key).await.unwrap().unwrap();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "SAVEPOINT s1; SET LOCAL search_path TO {home}; ROLLBACK TO SAVEPOINT s1; \
             INSERT INTO effects (consumer, label) VALUES ('orders', '{key}')"
        )))
        .execute(claimed.connection())
        .await
        .unwrap();
        claimed.commit().await.unwrap();
    }
    let expected_a: Vec<String> = {
        let mut v: Vec<String> = (0..2)
            .flat_map(|r| {
                (0..statements.len())
                    .map(move |n| format!("{r}-{n}"))
                    .chain([format!("{r}-savepoint")])
            })
            .collect();
        v.sort();
        v
    };
    let mut expected_b = expected_a.clone();
    expected_b.retain(|k| !k.ends_with("savepoint"));
    assert_eq!(labels(&s.admin, &a).await, expected_a, "a's effects");
    assert_eq!(labels(&s.admin, &b).await, expected_b, "b's effects");
    s.assert_home_untouched().await;
}

/// Tenants with pipelined claims on one connection: a tenant's first claim there, which finds its
/// prepared claim missing (the session never prepared it), keeps the driver's cached statements
/// (forgetting them would cost every cached statement a new preparation, once per connection and
/// tenant); a `DEALLOCATE ALL`, which takes them all, still has them forgotten (the test above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_first_pipelined_claim_on_a_connection_keeps_the_drivers_statements() {
    let s = Setup::new(6, 1).await;
    let tenants = s.tenants(&Inbox::new(s.pool.clone()).with_pipelined_claim());
    tenants.migrate().await.unwrap();
    let mut cached = Vec::new();
    for (n, name) in s.names.iter().enumerate() {
        let inbox = tenants.inbox(name).unwrap();
        let mut claimed = inbox.claim("orders", "k").await.unwrap().unwrap();
        let conn = claimed.connection();
        let before = sqlx::Connection::cached_statements_size(&*conn);
        // A statement of this tenant's body, cached by the driver (one more each tenant).
        let sql = format!("INSERT INTO effects (consumer, label) SELECT 'orders', 'k' || {n}");
        sqlx::query(AssertSqlSafe(sql))
            .execute(&mut *conn)
            .await
            .unwrap();
        cached.push((before, sqlx::Connection::cached_statements_size(&*conn)));
        claimed.commit().await.unwrap();
    }
    // Each tenant's first claim found the statements cached by the tenants before it.
    for (n, window) in cached.windows(2).enumerate() {
        let ((_, after), (before, _)) = (window[0], window[1]);
        assert!(
            before >= after,
            "tenant {}'s first claim forgot the driver's statements: {cached:?}",
            n + 1
        );
    }
    assert!(cached.last().unwrap().1 >= s.names.len(), "{cached:?}");
    for name in &s.names {
        assert_eq!(s.count(&format!("{name}.effects")).await, 1, "{name}");
    }
    s.assert_home_untouched().await;
}

// ---------------------------------------------------------------------------------------------
// 8. The longest names; 9. with_table and with_schema in either order.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn longest_schema_and_table_names_migrate_and_work() {
    let admin = admin().await;
    let id = id();
    let schema = format!("s{id}{}", "x".repeat(63 - 1 - id.len()));
    assert_eq!(schema.len(), 63);
    let table = format!("t{}", "y".repeat(47));
    create_schema(&admin, &schema).await;
    let pool = PgPoolOptions::new()
        .max_connections(3)
        .connect_lazy_with(pg_options());
    let inbox = Inbox::new(pool)
        .with_schema(&schema)
        .unwrap()
        .with_table(&table)
        .unwrap();
    assert!(
        Inbox::new(admin.clone())
            .with_schema(&format!("{schema}z"))
            .is_err()
    );
    assert!(
        Inbox::new(admin.clone())
            .with_table(&format!("{table}z"))
            .is_err()
    );
    let first = inbox.migrate().await.unwrap();
    let again = inbox.migrate().await.unwrap();
    assert_eq!(
        again.from, first.to,
        "the second migrate did not find the version"
    );
    let names: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 ORDER BY 1",
    )
    .bind(&schema)
    .fetch_all(&admin)
    .await
    .unwrap();
    let ours = names.iter().filter(|n| n.starts_with(&table)).count();
    assert!(ours >= 14, "tables and indexes: {names:?}");
    let tenants = Tenants::new().with("long", inbox.clone());
    let inbox = tenants.inbox("long").unwrap();
    assert!(handle(inbox, "k", "long", "long", Some("o")).await.unwrap());
    assert!(!handle(inbox, "k", "long", "long", Some("o")).await.unwrap());
    let publisher = RecordingPublisher::new();
    let relay = tenants.spawn_relay(publisher.clone(), fast_relay());
    let ok = wait_until(Duration::from_secs(10), || publisher.published().len() == 1).await;
    relay.shutdown().await;
    assert!(ok);
    inbox.purge_expired(10).await.unwrap();
    assert_eq!(count(&admin, &format!("{schema}.effects")).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_table_and_with_schema_keep_each_other_in_either_order() {
    let s = Setup::new(1, 2).await;
    let name = &s.names[0];
    let base = Inbox::new(s.pool.clone()).with_pipelined_claim();
    let one = base
        .clone()
        .with_schema(name)
        .unwrap()
        .with_table("orders_in")
        .unwrap();
    let two = base
        .with_table("orders_in")
        .unwrap()
        .with_schema(name)
        .unwrap();
    assert_eq!(one.table().to_string(), format!("{name}.orders_in"));
    assert_eq!(two.table().to_string(), format!("{name}.orders_in"));
    one.migrate().await.unwrap();
    assert_eq!(
        two.migrate().await.unwrap().from,
        one.migrate().await.unwrap().to
    );
    assert!(handle(&one, "k", "one", "one", None).await.unwrap());
    assert!(!handle(&two, "k", "two", "two", None).await.unwrap());
    assert_eq!(s.count(&format!("{name}.orders_in")).await, 1);
    assert_eq!(labels(&s.admin, name).await, ["one"]);
    s.assert_home_untouched().await;
}

// ---------------------------------------------------------------------------------------------
// The relay's LISTEN for tenants in databases of their own on one PostgreSQL server.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_in_two_postgres_databases_each_wake_the_relay() {
    let admin = admin().await;
    let id = id();
    let databases = [format!("db_x_{id}"), format!("db_y_{id}")];
    let mut tenants = Tenants::new();
    for database in &databases {
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {database}")))
            .execute(&admin)
            .await
            .unwrap();
        let pool = PgPoolOptions::new()
            .max_connections(3)
            .connect_lazy_with(pg_options().database(database));
        tenants = tenants.with(database, Inbox::new(pool));
    }
    tenants.migrate().await.unwrap();
    // An idle relay looks again only after 30 s: only a notification wakes it sooner.
    let options = RelayOptions::default()
        .listen(true)
        .poll_interval(Duration::from_secs(30), Duration::from_secs(30));
    let publisher = RecordingPublisher::new();
    let relay = tenants.spawn_relay(publisher.clone(), options);
    // Let the listeners start and the first rounds go by.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut times = BTreeMap::new();
    for (n, database) in databases.iter().enumerate() {
        let inbox = tenants.inbox(database).unwrap();
        let mut outbox = Outbox::new("direct", database.as_str()).unwrap();
        outbox.send(OutgoingMessage::new(
            Destination::queue("q"),
            database.clone().into_bytes(),
        ));
        let mut tx = inbox.pool().begin().await.unwrap();
        inbox.enqueue(&mut tx, outbox).await.unwrap();
        tx.commit().await.unwrap();
        let started = Instant::now();
        let ok = wait_until(Duration::from_secs(8), || publisher.published().len() > n).await;
        times.insert(database.clone(), (ok, started.elapsed()));
    }
    relay.stop();
    for database in &databases {
        let _ = sqlx::query(AssertSqlSafe(format!(
            "DROP DATABASE {database} WITH (FORCE)"
        )))
        .execute(&admin)
        .await;
    }
    for (database, (ok, took)) in &times {
        assert!(
            ok,
            "{database}'s commit woke no relay (waited {took:?}): {times:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 10. MariaDB tenants by database, one dropped while the relay runs.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_tenants_keep_flowing_when_one_database_is_dropped() {
    let options: MySqlConnectOptions = std::env::var("IDEMPOTENT_MYSQL_URL")
        .expect("IDEMPOTENT_MYSQL_URL is not set")
        .parse()
        .unwrap();
    let id = id();
    let names = [format!("ma_{id}"), format!("mb_{id}"), format!("mc_{id}")];
    let mut admin = options.connect().await.unwrap();
    let mut tenants: Tenants<MySql> = Tenants::new();
    for name in &names {
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await
            .unwrap();
        let pool = MySqlPoolOptions::new()
            .max_connections(3)
            .acquire_timeout(Duration::from_secs(10))
            .connect_lazy_with(options.clone().database(name));
        sqlx::query(CREATE_EFFECTS).execute(&pool).await.unwrap();
        tenants = tenants.with(name, Inbox::new(pool));
    }
    tenants.migrate().await.unwrap();
    async fn handle_my(inbox: &Inbox<MySql>, key: &str) -> Result<bool, InboxError> {
        let Some(mut claimed) = inbox.claim("orders", key).await? else {
            return Ok(false);
        };
        sqlx::query("INSERT INTO effects (consumer, label) VALUES ('orders', ?)")
            .bind(key)
            .execute(claimed.connection())
            .await
            .unwrap();
        claimed.outbox().send(OutgoingMessage::new(
            Destination::queue("q"),
            key.as_bytes().to_vec(),
        ));
        claimed.commit().await?;
        Ok(true)
    }
    let publisher = RecordingPublisher::new();
    let relay = tenants.spawn_relay(publisher.clone(), fast_relay());
    for name in &names {
        handle_my(tenants.inbox(name).unwrap(), &format!("{name}:0"))
            .await
            .unwrap();
    }
    assert!(wait_until(Duration::from_secs(10), || publisher.published().len() >= 3).await);
    sqlx::query(AssertSqlSafe(format!("DROP DATABASE {}", names[1])))
        .execute(&mut admin)
        .await
        .unwrap();
    let error = handle_my(tenants.inbox(&names[1]).unwrap(), "gone")
        .await
        .expect_err("a claim in a dropped database");
    eprintln!("claim in a dropped MariaDB database: {error}");
    for n in 1..=10 {
        for name in [&names[0], &names[2]] {
            assert!(
                handle_my(tenants.inbox(name).unwrap(), &format!("{name}:{n}"))
                    .await
                    .unwrap()
            );
        }
    }
    let flowed = wait_until(Duration::from_secs(10), || {
        publisher.published().len() >= 23
    })
    .await;
    let stats = relay.shutdown().await;
    assert!(flowed, "stalled: {stats:?} {:?}", payloads(&publisher));
    let published = payloads(&publisher);
    let unique: HashSet<_> = published.iter().collect();
    assert_eq!(unique.len(), 23, "{published:?}");
    for name in [&names[0], &names[2]] {
        let effects: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {name}.effects"
        )))
        .fetch_one(&mut admin)
        .await
        .unwrap();
        assert_eq!(effects, 11, "{name}");
    }
    for name in [&names[0], &names[2]] {
        let _ = sqlx::query(AssertSqlSafe(format!("DROP DATABASE {name}")))
            .execute(&mut admin)
            .await;
    }
}
