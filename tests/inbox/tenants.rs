//! Tenants side by side on one server: by schema on PostgreSQL (each tenant's pool has a
//! `search_path` of its own schema, then a shared one that has the tables already, as `public`
//! often does), by database on MySQL/MariaDB. `migrate()` creates each tenant's tables where its
//! connections create tables, and every statement then uses those: the same keys are processed
//! once in each tenant, each tenant's effects and rows in its own tables, none in the shared ones.
#![cfg(all(feature = "postgres", feature = "mysql", feature = "testing"))]

#[path = "../support/mod.rs"]
mod support;

use idempotent::outbox::{Destination, OutgoingMessage};
use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use idempotent::outbox::{Outbox, RelayOptions};
use idempotent::testing::RecordingPublisher;
use idempotent::{Backend, Inbox, InboxError, Tenants};
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions};

use support::CREATE_EFFECTS;

/// Messages per tenant, with the same keys in each.
const MESSAGES: usize = 60;

/// Every table the inbox has at the current version, by its suffix.
const TABLES: [&str; 7] = [
    "",
    "_calls",
    "_horizons",
    "_audit",
    "_schema",
    "_outbox",
    "_outbox_keys",
];

/// Processes `MESSAGES` keys on `inbox`; see [`process`].
async fn process_all<DB: Backend>(tenant: &str, inbox: &Inbox<DB>)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    process(tenant, inbox, MESSAGES).await
}

/// Processes `messages` keys on `inbox`, each writing its effect (and one outgoing message to the
/// routing key `tenant`) in the claim's transaction, then delivers each again: every key
/// processed once, every copy a duplicate.
async fn process<DB: Backend>(tenant: &str, inbox: &Inbox<DB>, messages: usize)
where
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
{
    for round in ["first", "again"] {
        for n in 0..messages {
            let key = format!("order-{n}");
            let claimed = inbox.claim("orders", &key).await.unwrap();
            match (round, claimed) {
                ("first", Some(mut claimed)) => {
                    sqlx::raw_sql(AssertSqlSafe(format!(
                        "INSERT INTO effects (consumer, label) VALUES ('orders', '{key}')"
                    )))
                    .execute(claimed.connection())
                    .await
                    .unwrap();
                    claimed.outbox().send(OutgoingMessage::new(
                        Destination::exchange("shop", tenant),
                        key.clone().into_bytes(),
                    ));
                    claimed.commit().await.unwrap();
                }
                ("first", None) => {
                    panic!("{tenant}: {key} was a duplicate on its first delivery")
                }
                (_, Some(claimed)) => {
                    claimed.rollback().await;
                    panic!("{tenant}: {key} was processed again")
                }
                (_, None) => {}
            }
        }
    }
    let forgotten = inbox
        .forget("orders", "order-0", "a tenant's own audit row")
        .await
        .unwrap();
    assert!(forgotten, "{tenant}: order-0 has its record");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_by_schema_on_postgres_each_have_their_own_tables() {
    let options: PgConnectOptions = support::postgres::url().parse().expect("IDEMPOTENT_PG_URL");
    let id = uuid::Uuid::new_v4().simple().to_string();
    let shared = format!("shared_{id}");
    let tenants = [format!("tenant_a_{id}"), format!("tenant_b_{id}")];
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options.clone())
        .await
        .unwrap();
    for schema in tenants.iter().chain([&shared]) {
        sqlx::query(AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&admin)
            .await
            .unwrap();
    }
    let pool = |search_path: String| {
        PgPoolOptions::new()
            .max_connections(4)
            .connect_lazy_with(options.clone().options([("search_path", search_path)]))
    };
    // The schema at the end of every tenant's search_path has the tables already.
    let migrated = Inbox::new(pool(shared.clone())).migrate().await.unwrap();
    assert_eq!(migrated.from, 0);

    let mut migrations = Vec::new();
    for tenant in &tenants {
        let pool = pool(format!("{tenant}, {shared}"));
        sqlx::query(CREATE_EFFECTS).execute(&pool).await.unwrap();
        let inbox = Inbox::new(pool);
        migrations.push(inbox.migrate().await.unwrap());
        process_all(tenant, &inbox).await;
    }
    for (tenant, migrated) in tenants.iter().zip(migrations) {
        assert_eq!(
            migrated.from, 0,
            "{tenant}: migrate() found the shared schema's tables instead of creating its own"
        );
    }

    let count = async |table: String| -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) FROM {table}")))
            .fetch_one(&admin)
            .await
            .unwrap()
    };
    for tenant in &tenants {
        for suffix in TABLES {
            let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
                .bind(format!("{tenant}.\"idempotent_inbox{suffix}\""))
                .fetch_one(&admin)
                .await
                .unwrap();
            assert!(exists, "{tenant} has no idempotent_inbox{suffix}");
        }
        let t = format!("{tenant}.idempotent_inbox");
        assert_eq!(count(format!("{tenant}.effects")).await, MESSAGES as i64);
        assert_eq!(count(t.clone()).await, MESSAGES as i64 - 1, "{tenant}");
        assert_eq!(count(format!("{t}_audit")).await, 1, "{tenant}");
        assert_eq!(count(format!("{t}_outbox")).await, MESSAGES as i64);
    }
    let s = format!("{shared}.idempotent_inbox");
    for table in [s.clone(), format!("{s}_audit"), format!("{s}_outbox")] {
        assert_eq!(
            count(table.clone()).await,
            0,
            "{table}: a tenant wrote here"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_by_database_on_mysql_each_have_their_own_tables() {
    let options: MySqlConnectOptions = support::mysql::url().parse().expect("IDEMPOTENT_MYSQL_URL");
    let id = uuid::Uuid::new_v4().simple().to_string();
    let shared = format!("shared_{id}");
    let names = [
        format!("tenant_a_{id}"),
        format!("tenant_b_{id}"),
        format!("tenant_c_{id}"),
    ];
    let mut admin = options.connect().await.unwrap();
    for database in names.iter().chain([&shared]) {
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {database}")))
            .execute(&mut admin)
            .await
            .unwrap();
    }
    let pool = |database: &str| {
        MySqlPoolOptions::new()
            .max_connections(4)
            .connect_lazy_with(options.clone().database(database))
    };
    // Another database on the server, the one the account's connections default to, say, has
    // the tables already.
    let migrated = Inbox::new(pool(&shared)).migrate().await.unwrap();
    assert_eq!(migrated.from, 0);

    // A pool per tenant, each on its tenant's database.
    let mut tenants = Tenants::new();
    for name in &names {
        let pool = pool(name);
        sqlx::query(CREATE_EFFECTS).execute(&pool).await.unwrap();
        tenants = tenants.with(name, Inbox::new(pool));
    }
    for (tenant, migrated) in tenants.migrate().await.unwrap() {
        assert_eq!(
            migrated.from, 0,
            "{tenant}: migrate() found another's tables"
        );
    }
    for name in &names {
        process_all(name, tenants.inbox(name).unwrap()).await;
    }
    let publisher = RecordingPublisher::new();
    let relay = tenants.spawn_relay(publisher.clone(), RelayOptions::default());
    let published = published(&publisher, names.len() * MESSAGES).await;
    relay.shutdown().await;
    for name in &names {
        let ids: HashSet<&str> = published
            .iter()
            .filter(|p| p.destination.routing_key == *name)
            .map(|p| p.message_id.as_str())
            .collect();
        assert_eq!(ids.len(), MESSAGES, "{name}: not each message published");
    }
    let all: HashSet<&str> = published.iter().map(|p| p.message_id.as_str()).collect();
    assert_eq!(
        all.len(),
        names.len() * MESSAGES,
        "tenants' messages share ids"
    );
    assert_eq!(
        publisher.published().len(),
        names.len() * MESSAGES,
        "published more than once"
    );
    let mut count = async |table: String| -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) FROM {table}")))
            .fetch_one(&mut admin)
            .await
            .unwrap()
    };
    for tenant in &names {
        for suffix in TABLES {
            count(format!("{tenant}.idempotent_inbox{suffix}")).await;
        }
        let t = format!("{tenant}.idempotent_inbox");
        assert_eq!(count(format!("{tenant}.effects")).await, MESSAGES as i64);
        assert_eq!(count(t.clone()).await, MESSAGES as i64 - 1, "{tenant}");
        assert_eq!(count(format!("{t}_audit")).await, 1, "{tenant}");
        assert_eq!(count(format!("{t}_outbox")).await, MESSAGES as i64);
    }
    let s = format!("{shared}.idempotent_inbox");
    for table in [s.clone(), format!("{s}_audit"), format!("{s}_outbox")] {
        assert_eq!(
            count(table.clone()).await,
            0,
            "{table}: a tenant wrote here"
        );
    }
}

/// Tenants in schemas of one PostgreSQL database, sharing one pool.
const SCHEMA_TENANTS: usize = 100;

/// Messages per tenant of the hundred.
const TENANT_MESSAGES: usize = 10;

/// A pool whose connections' own schema is `home`, and a client for the test's own statements.
async fn pools_at_home(home: &str, connections: u32) -> (sqlx::PgPool, sqlx::PgPool) {
    let options: PgConnectOptions = support::postgres::url().parse().expect("IDEMPOTENT_PG_URL");
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(options.clone())
        .await
        .unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(connections)
        .connect_lazy_with(options.options([("search_path", home)]));
    (pool, admin)
}

async fn count_in(admin: &sqlx::PgPool, table: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) FROM {table}")))
        .fetch_one(admin)
        .await
        .unwrap()
}

/// Waits until `publisher` took `expected` publications (at most 60 s), and returns them.
async fn published(
    publisher: &RecordingPublisher,
    expected: usize,
) -> Vec<idempotent::outbox::Publication> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let published = publisher.published();
        if published.len() >= expected || Instant::now() > deadline {
            return published;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_tenants_in_schemas_share_one_pool_and_one_relay() {
    let id = uuid::Uuid::new_v4().simple().to_string();
    // The schema the pool's connections are in: it has every table a tenant has, and nothing may
    // land in it.
    let home = format!("home_{id}");
    let names: Vec<String> = (0..SCHEMA_TENANTS)
        .map(|n| format!("t{n:03}_{id}"))
        .collect();
    // Fewer connections than tenants: they are shared.
    let (pool, admin) = pools_at_home(&home, 8).await;
    for schema in names.iter().chain([&home]) {
        support::postgres::create_schema_with_effects(&admin, schema).await;
    }
    Inbox::new(pool.clone()).migrate().await.unwrap();

    // Half the tenants claim with the claim in the BEGIN's message, half without.
    let plain = Inbox::new(pool.clone());
    let pipelined = Inbox::new(pool.clone()).with_pipelined_claim();
    let mut tenants = Tenants::by_schema(&plain, names.iter().map(String::as_str)).unwrap();
    for name in names.iter().skip(1).step_by(2) {
        tenants = tenants.with(name, pipelined.clone().with_schema(name).unwrap());
    }
    assert_eq!(tenants.len(), SCHEMA_TENANTS);
    let migrated = tenants.migrate().await.unwrap();
    assert_eq!(migrated.len(), SCHEMA_TENANTS);
    for (tenant, migration) in &migrated {
        assert_eq!(
            migration.from, 0,
            "{tenant}: found tables of another schema"
        );
    }
    match tenants.inbox("nobody") {
        Err(error @ InboxError::UnknownTenant { .. }) => assert!(!error.is_retryable()),
        other => panic!("an unknown tenant gave {other:?}"),
    }

    // Eight workers over the hundred tenants, the same keys in each.
    let workers: Vec<_> = names
        .chunks(SCHEMA_TENANTS / 8 + 1)
        .map(|chunk| {
            let (tenants, chunk) = (tenants.clone(), chunk.to_vec());
            let chunk: Vec<String> = chunk;
            tokio::spawn(async move {
                for name in chunk {
                    process(&name, tenants.inbox(&name).unwrap(), TENANT_MESSAGES).await;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }

    // One relay for all of them publishes each tenant's messages once.
    let publisher = RecordingPublisher::new();
    let relay = tenants.spawn_relay(publisher.clone(), RelayOptions::default().workers(2));
    let total = SCHEMA_TENANTS * TENANT_MESSAGES;
    published(&publisher, total).await;
    relay.shutdown().await;
    let published = publisher.published();
    let ids: HashSet<&str> = published.iter().map(|p| p.message_id.as_str()).collect();
    assert_eq!(published.len(), total, "published more or fewer than once");
    // The same keys in every tenant, and yet ids of their own: downstream, a hundred messages.
    assert_eq!(ids.len(), total, "tenants' messages share ids");
    let mut by_tenant: BTreeMap<&str, usize> = BTreeMap::new();
    for publication in &published {
        *by_tenant
            .entry(publication.destination.routing_key.as_str())
            .or_default() += 1;
    }
    for name in &names {
        assert_eq!(
            by_tenant.get(name.as_str()),
            Some(&TENANT_MESSAGES),
            "{name}"
        );
        let t = format!("{name}.idempotent_inbox");
        let tenant_messages = TENANT_MESSAGES as i64;
        assert_eq!(
            count_in(&admin, &format!("{name}.effects")).await,
            tenant_messages
        );
        assert_eq!(count_in(&admin, &t).await, tenant_messages - 1, "{name}");
        assert_eq!(count_in(&admin, &format!("{t}_audit")).await, 1, "{name}");
        let sent = format!("{t}_outbox WHERE state = 1");
        assert_eq!(count_in(&admin, &sent).await, tenant_messages, "{name}");
    }
    let h = format!("{home}.idempotent_inbox");
    for table in [
        format!("{home}.effects"),
        h.clone(),
        format!("{h}_audit"),
        format!("{h}_outbox"),
    ] {
        assert_eq!(
            count_in(&admin, &table).await,
            0,
            "{table}: a tenant wrote here"
        );
    }
}

/// Quiet tenants beside a busy one.
const QUIET_TENANTS: usize = 19;
const QUIET_MESSAGES: usize = 10;
const BUSY_MESSAGES: usize = 3_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_relay_serves_quiet_tenants_beside_a_busy_one() {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let home = format!("home_{id}");
    // First in the tenants' order, so a relay that drained one tenant after another would
    // drain it first.
    let busy = format!("a_busy_{id}");
    let quiet: Vec<String> = (0..QUIET_TENANTS)
        .map(|n| format!("q{n:02}_{id}"))
        .collect();
    let (pool, admin) = pools_at_home(&home, 4).await;
    for schema in quiet.iter().chain([&busy, &home]) {
        support::postgres::create_schema_with_effects(&admin, schema).await;
    }
    let tenants = Tenants::by_schema(
        &Inbox::new(pool.clone()),
        quiet.iter().chain([&busy]).map(String::as_str),
    )
    .unwrap();
    tenants.migrate().await.unwrap();
    let enqueue = async |tenant: &str, messages: usize| {
        let inbox = tenants.inbox(tenant).unwrap();
        for (part, first) in (0..messages).step_by(500).enumerate() {
            let mut outbox = Outbox::new("seed", &format!("part-{part}")).unwrap();
            for n in first..messages.min(first + 500) {
                outbox.send(OutgoingMessage::new(
                    Destination::exchange("shop", tenant),
                    n.to_string().into_bytes(),
                ));
            }
            let mut tx = pool.begin().await.unwrap();
            inbox.enqueue(&mut tx, outbox).await.unwrap();
            tx.commit().await.unwrap();
        }
    };
    enqueue(&busy, BUSY_MESSAGES).await;
    for name in &quiet {
        enqueue(name, QUIET_MESSAGES).await;
    }

    let publisher = RecordingPublisher::new();
    let started = Instant::now();
    let relay = tenants.spawn_relay(publisher.clone(), RelayOptions::default().listen(false));
    let quiet_total = QUIET_TENANTS * QUIET_MESSAGES;
    let total = BUSY_MESSAGES + quiet_total;
    let mut quiet_done = None;
    while publisher.published().len() < total && started.elapsed() < Duration::from_secs(60) {
        let published = publisher.published();
        let quiet_out = published
            .iter()
            .filter(|p| p.destination.routing_key != busy)
            .count();
        if quiet_done.is_none() && quiet_out == quiet_total {
            quiet_done = Some((started.elapsed(), published.len() - quiet_out));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let all_done = started.elapsed();
    relay.shutdown().await;
    let published = publisher.published();
    assert_eq!(published.len(), total);
    // Where the quiet tenants' last message went out, in the order of all.
    let last_quiet = published
        .iter()
        .rposition(|p| p.destination.routing_key != busy)
        .unwrap()
        + 1;
    let (quiet_after, busy_before) = quiet_done.unwrap_or((all_done, BUSY_MESSAGES));
    println!(
        "fairness: {QUIET_TENANTS} quiet tenants' {quiet_total} messages all out at position \
         {last_quiet} of {total} ({:.2}), after {} ms and {busy_before} of the busy tenant's \
         {BUSY_MESSAGES}; the whole backlog took {} ms",
        last_quiet as f64 / total as f64,
        quiet_after.as_millis(),
        all_done.as_millis(),
    );
    // One batch of each tenant a round: the quiet tenants are out within the first rounds. A
    // relay that drained the busy tenant first would put them past 0.9.
    assert!(
        last_quiet <= total / 4,
        "the quiet tenants waited behind the busy one: their last message went out at {last_quiet} of {total}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_purger_purges_every_tenant_past_a_broken_one() {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let home = format!("home_{id}");
    let (pool, admin) = pools_at_home(&home, 4).await;
    // First in the tenants' order, and its schema was never made: its purge fails each time.
    let broken = format!("a_broken_{id}");
    let names: Vec<String> = (0..4).map(|n| format!("p{n}_{id}")).collect();
    for schema in names.iter().chain([&home]) {
        support::postgres::create_schema_with_effects(&admin, schema).await;
    }
    let retained = Inbox::new(pool.clone()).with_retention(Duration::from_millis(1));
    let tenants = Tenants::by_schema(&retained, names.iter().map(String::as_str))
        .unwrap()
        .with(&broken, retained.clone().with_schema(&broken).unwrap());
    for name in &names {
        let inbox = tenants.inbox(name).unwrap();
        inbox.migrate().await.unwrap();
        process(name, inbox, TENANT_MESSAGES).await;
    }
    let broken_purge = tenants.inbox(&broken).unwrap().purge_expired(100).await;
    assert!(
        broken_purge.is_err(),
        "the broken tenant purged: {broken_purge:?}"
    );
    let purger = tenants.spawn_purger(idempotent::PurgerOptions::every(Duration::from_millis(50)));
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut left = Vec::new();
    loop {
        left.clear();
        for name in &names {
            left.push(count_in(&admin, &format!("{name}.idempotent_inbox")).await);
        }
        if left.iter().all(|rows| *rows == 0) || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    purger.stop();
    assert!(
        left.iter().all(|rows| *rows == 0),
        "rows left in the tenants' inboxes: {left:?}"
    );
    assert_eq!(
        count_in(&admin, &format!("{}.effects", names[0])).await,
        TENANT_MESSAGES as i64,
        "the purge took the tenant's own rows"
    );
}
