//! A fresh database per test in the MySQL or MariaDB that `IDEMPOTENT_MYSQL_URL` points to.

use std::time::Duration;

use idempotent::Inbox;
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use sqlx::{ConnectOptions, MySql};

use super::{CREATE_EFFECTS, Consumer, Delivery, Harness, Outcome, Quote};

mod handlers {
    crate::support::effect_handlers!(
        sqlx::MySqlConnection,
        "INSERT INTO effects (consumer, label) VALUES (?, ?)"
    );
}

/// The server the tests run against. `scripts/test` starts one; CI does too.
pub fn url() -> String {
    std::env::var("IDEMPOTENT_MYSQL_URL").expect(
        "IDEMPOTENT_MYSQL_URL is not set: run the tests with scripts/test, which starts MariaDB",
    )
}

pub struct MySqlHarness {
    pub inbox: Inbox<MySql>,
    pub impatient: Inbox<MySql>,
    /// The harness's own statements, and what the tests look at.
    pub pool: MySqlPool,
    pub database: String,
    /// Connected to the node the inbox claims on: where a claim's lock wait shows.
    pub inbox_node: MySqlPool,
    /// On Galera: the test database on each node, in the order of `IDEMPOTENT_GALERA_URLS`.
    pub nodes: Vec<MySqlConnectOptions>,
    /// On Galera: the node (0-based) of the inboxes [`Harness::inbox_with_pool`] makes.
    pub other_node: usize,
}

impl MySqlHarness {
    pub async fn new() -> Self {
        let options: MySqlConnectOptions = url().parse().expect("IDEMPOTENT_MYSQL_URL");
        let database = create_database(&options).await;
        let options = options.database(&database);
        let pool = MySqlPoolOptions::new()
            .max_connections(40)
            .connect_with(options.clone())
            .await
            .expect("connect to MySQL");
        let impatient = impatient_pool(options);
        Self::set_up(
            Inbox::new(pool.clone()),
            Inbox::new(impatient),
            pool,
            database,
            vec![],
        )
        .await
    }

    /// A harness on the three-node Galera cluster of `IDEMPOTENT_GALERA_URLS` (which
    /// `scripts/galera start` sets), with its connections on different nodes: the inbox (and the
    /// impatient inbox, whose lock wait is a node's own) on node 1, the inboxes of
    /// [`inbox_with_pool`](Harness::inbox_with_pool) on node 2, and the harness's own statements
    /// and reads on node 3. Those read with `wsrep_sync_wait` (a node first applies what the
    /// cluster committed before the read), and after the harness writes rows (bulk rows, a
    /// backdate) it waits until nodes 1 and 2 have applied them too: what a test checks on one node
    /// right after another committed is then what was committed.
    pub async fn on_galera() -> Self {
        let urls = galera_urls();
        let first: MySqlConnectOptions = urls[0].parse().expect("IDEMPOTENT_GALERA_URLS");
        let database = create_database(&first).await;
        // The other nodes have applied the `CREATE DATABASE` before anything connects to it.
        for url in &urls {
            let options: MySqlConnectOptions = url.parse().expect("IDEMPOTENT_GALERA_URLS");
            let mut conn = options.connect().await.expect("a Galera node");
            causal(&mut conn).await.unwrap();
            sqlx::query("SELECT 1").execute(&mut conn).await.unwrap();
        }
        let nodes: Vec<MySqlConnectOptions> = urls
            .iter()
            .map(|url| {
                let options: MySqlConnectOptions = url.parse().expect("IDEMPOTENT_GALERA_URLS");
                options.database(&database)
            })
            .collect();
        let inbox = MySqlPoolOptions::new()
            .max_connections(40)
            .connect_lazy_with(nodes[0].clone());
        let impatient = impatient_pool(nodes[0].clone());
        let pool = MySqlPoolOptions::new()
            .max_connections(10)
            .after_connect(|conn, _| Box::pin(async move { causal(conn).await }))
            .connect_lazy_with(nodes[2].clone());
        Self::set_up(
            Inbox::new(inbox),
            Inbox::new(impatient),
            pool,
            database,
            nodes,
        )
        .await
    }

    async fn set_up(
        inbox: Inbox<MySql>,
        impatient: Inbox<MySql>,
        pool: MySqlPool,
        database: String,
        nodes: Vec<MySqlConnectOptions>,
    ) -> Self {
        sqlx::query(CREATE_EFFECTS).execute(&pool).await.unwrap();
        for statement in super::CREATE_UNIQUES {
            sqlx::query(statement).execute(&pool).await.unwrap();
        }
        inbox.migrate().await.expect("migrate");
        let inbox_node = MySqlPoolOptions::new()
            .max_connections(2)
            .connect_lazy_with(inbox.pool().connect_options().as_ref().clone());
        let h = Self {
            inbox,
            impatient,
            pool,
            database,
            inbox_node,
            nodes,
            other_node: 1,
        };
        h.sync_nodes().await;
        h
    }

    /// This harness, its other inboxes on Galera node `node` (0-based; the inbox's own is 0).
    pub fn others_on_node(self, node: usize) -> Self {
        Self {
            other_node: node,
            ..self
        }
    }

    /// A pool of `connections` on Galera node `node` (0-based), its sessions reading causally
    /// when `causal`.
    pub fn node_pool(&self, node: usize, connections: u32, causal_reads: bool) -> MySqlPool {
        let options = MySqlPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(Duration::from_secs(10));
        let options = if causal_reads {
            options.after_connect(|conn, _| Box::pin(async move { causal(conn).await }))
        } else {
            options
        };
        options.connect_lazy_with(self.nodes[node].clone())
    }

    /// On Galera, returns once every node has applied what the cluster committed so far.
    pub async fn sync_nodes(&self) {
        for node in &self.nodes {
            let mut conn = node.connect().await.expect("a Galera node");
            causal(&mut conn).await.unwrap();
            sqlx::query("SELECT 1").execute(&mut conn).await.unwrap();
        }
    }
}

/// Makes a Galera session's reads, updates, deletes and inserts wait until its node has applied
/// everything the cluster committed before they began (`wsrep_sync_wait = 15`).
pub async fn causal(conn: &mut sqlx::MySqlConnection) -> Result<(), sqlx::Error> {
    sqlx::query("SET SESSION wsrep_sync_wait = 15")
        .execute(conn)
        .await
        .map(drop)
}

/// The URLs of the Galera cluster's nodes.
pub fn galera_urls() -> Vec<String> {
    let urls = std::env::var("IDEMPOTENT_GALERA_URLS").expect(
        "IDEMPOTENT_GALERA_URLS is not set: run the tests with scripts/test, which starts a Galera cluster",
    );
    let urls: Vec<String> = urls.split(',').map(str::to_owned).collect();
    assert_eq!(urls.len(), 3, "three Galera nodes: {urls:?}");
    urls
}

/// Creates a fresh database, named for the test, on the server (or cluster) of `options`.
async fn create_database(options: &MySqlConnectOptions) -> String {
    let database = format!("t_{}", uuid::Uuid::new_v4().simple());
    let mut admin = options.connect().await.expect("connect to MySQL");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
        .execute(&mut admin)
        .await
        .unwrap();
    database
}

/// A pool whose connections give up waiting for a lock after a second.
fn impatient_pool(options: MySqlConnectOptions) -> MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::query("SET SESSION innodb_lock_wait_timeout = 1")
                    .execute(conn)
                    .await
                    .map(drop)
            })
        })
        .connect_lazy_with(options)
}

impl Harness for MySqlHarness {
    crate::support::harness_methods!("?", "?");

    type Db = MySql;

    fn inbox_with_pool(&self, connections: u32) -> Inbox<Self::Db> {
        // On Galera, on another node than the inbox's (unless told otherwise).
        let options = match self.nodes.get(self.other_node) {
            Some(node) => node.clone(),
            None => self.pool.connect_options().as_ref().clone(),
        };
        let pool = MySqlPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(options);
        Inbox::new(pool)
    }

    async fn bulk_rows(&self, consumer: &str, rows: usize) {
        // MariaDB's sequence engine: seq_1_to_N is a table of the numbers 1 to N.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO idempotent_inbox (consumer, message_key, processed_at)
             SELECT ?, CAST(seq AS BINARY), UTC_TIMESTAMP(6) FROM seq_1_to_{rows}"
        )))
        .bind(consumer)
        .execute(&self.pool)
        .await
        .unwrap();
        self.writes_applied().await;
    }

    async fn writes_applied(&self) {
        self.sync_nodes().await;
    }

    async fn backdate(&self, consumer: &str, by: Duration) {
        sqlx::query(
            "UPDATE idempotent_inbox SET processed_at = processed_at - INTERVAL (? * 1000) MICROSECOND
             WHERE consumer = ?",
        )
        .bind(by.as_millis() as i64)
        .bind(consumer)
        .execute(&self.pool)
        .await
        .unwrap();
        self.writes_applied().await;
    }

    async fn create_legacy_tables(&self, table: &str) {
        // The DDL of `idempotent-runtime/src/store/mysql.rs` in the first release (schema 1).
        let t = format!("`{table}`");
        let index = format!("`{table}_processed_at`");
        let calls = format!("`{table}_calls`");
        for statement in [
            format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                    consumer     VARBINARY(200) NOT NULL,
                    message_key  VARBINARY(255) NOT NULL,
                    processed_at DATETIME(6)    NOT NULL,
                    response     LONGBLOB,
                    fingerprint  VARBINARY(64),
                    PRIMARY KEY (consumer, message_key),
                    INDEX {index} (processed_at)
                ) ENGINE = InnoDB"
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {calls} (
                    consumer    VARBINARY(200) NOT NULL,
                    message_key VARBINARY(255) NOT NULL,
                    call_name   VARBINARY(200) NOT NULL,
                    fence       BIGINT         NOT NULL,
                    lease_until BIGINT         NOT NULL,
                    completed   BOOLEAN        NOT NULL,
                    result      LONGBLOB,
                    PRIMARY KEY (consumer, message_key, call_name)
                ) ENGINE = InnoDB"
            ),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(statement))
                .execute(&self.pool)
                .await
                .unwrap();
        }
        let (rows, call_rows) = super::legacy_rows();
        for (key, response, fingerprint) in rows {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {t} (consumer, message_key, processed_at, response, fingerprint)
                 VALUES ('old-orders', ?, UTC_TIMESTAMP(6), ?, ?)"
            )))
            .bind(key)
            .bind(response)
            .bind(fingerprint)
            .execute(&self.pool)
            .await
            .unwrap();
        }
        for (key, name, completed, result) in call_rows {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {calls} (consumer, message_key, call_name, fence, lease_until, completed, result)
                 VALUES ('old-orders', ?, ?, 1, ?, ?, ?)"
            )))
            .bind(key)
            .bind(name)
            .bind(super::FAR_LEASE_MS)
            .bind(completed)
            .bind(result)
            .execute(&self.pool)
            .await
            .unwrap();
        }
    }

    async fn wait_until_a_claim_blocks(&self) {
        // InnoDB's own lock-wait view (INNODB_TRX) is a cache refreshed at most every 100 ms while
        // it is read, so it can miss a wait for as long as it is polled; the process list is live.
        // A claim of this test's database that has been inserting for 200 ms is waiting on a lock:
        // an insert that does not wait takes microseconds. (TIME_MS is MariaDB's.)
        for _ in 0..500 {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST
                 WHERE DB = ? AND INFO LIKE 'INSERT IGNORE INTO `idempotent_inbox`%' AND TIME_MS > 200",
            )
            .bind(&self.database)
            .fetch_one(&self.inbox_node)
            .await
            .unwrap();
            if waiting > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("no claim ever waited on the uncommitted one");
    }
}
