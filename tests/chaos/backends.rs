//! The databases a run can use, each with a fresh database of its own, what its consumers connect
//! to, how the checker reads it, and the faults the run inflicts on it.

use sqlx::Connection;

/// A database prepared for one run.
pub struct Prepared {
    /// What each consumer connects to (a kind of server and its URLs), cycled over the consumers.
    pub targets: Vec<(String, String)>,
    /// The shell commands that break the database, one per fault asked for.
    pub faults: Vec<String>,
    /// Where the checker reads; for a primary that moves, asked when the run is over.
    pub check: Check,
    /// The checker reads with `wsrep_sync_wait`.
    pub causal: bool,
    /// What the run cannot do here, said before it starts.
    pub notes: Vec<String>,
    _dir: Option<tempfile::TempDir>,
}

/// Where the checker reads.
pub enum Check {
    Url(String),
    /// The current primary, from `$IDEMPOTENT_PG_HA_CTL primary`, with this database.
    Primary {
        ctl: String,
        database: String,
    },
}

impl Check {
    pub fn url(&self) -> String {
        match self {
            Check::Url(url) => url.clone(),
            Check::Primary { ctl, database } => {
                let primary = std::process::Command::new("sh")
                    .arg("-c")
                    .arg(format!("{ctl} primary"))
                    .output()
                    .expect("the primary's URL");
                let primary = String::from_utf8(primary.stdout).unwrap();
                with_database(primary.trim(), database)
            }
        }
    }
}

fn env(name: &str, how: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: {how}"))
}

/// `url` with its database replaced by `database`.
fn with_database(url: &str, database: &str) -> String {
    let (prefix, _) = url.rsplit_once('/').expect("a database in the URL");
    format!("{prefix}/{database}")
}

/// Runs a `scripts/` command and returns what it printed; panics when it fails.
fn script(command: &str) -> String {
    let output = std::process::Command::new("sh")
        .arg("-c")
        .arg(command)
        .output()
        .expect("sh");
    assert!(
        output.status.success(),
        "`{command}` failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// Prepares `backend` for a run with `faults` faults (as many as it can); on Galera, the consumers'
/// own nodes are the first `spread` nodes.
pub async fn prepare(backend: &str, faults: usize, spread: usize) -> Prepared {
    let mut notes = Vec::new();
    let mut dir = None;
    let single = |kind: &str, url: &str| vec![(kind.to_owned(), url.to_owned())];
    let (targets, fault_commands, check, causal) = match backend {
        "postgres" => {
            let base = env(
                "IDEMPOTENT_PG_URL",
                "run the tests with scripts/test, which starts PostgreSQL",
            );
            let url = fresh_postgres_database(&base).await;
            let restarts = match std::env::var("IDEMPOTENT_PG_RESTART") {
                Ok(restart) => alternate(faults, |i| {
                    format!("{restart} {}", ["immediate", "fast"][i % 2])
                }),
                Err(_) => {
                    notes.push(
                        "IDEMPOTENT_PG_RESTART is not set, so this run cannot restart PostgreSQL"
                            .into(),
                    );
                    vec![]
                }
            };
            (single("postgres", &url), restarts, Check::Url(url), false)
        }
        "pgbouncer" => {
            let bouncer = env(
                "IDEMPOTENT_PGBOUNCER_URL",
                "start PgBouncer with scripts/pgbouncer",
            );
            let upstream = env(
                "IDEMPOTENT_PGBOUNCER_UPSTREAM_URL",
                "start PgBouncer with scripts/pgbouncer",
            );
            let direct = fresh_postgres_database(&upstream).await;
            let database = direct.rsplit_once('/').unwrap().1.to_owned();
            // The upstream is restarted only when it is the server IDEMPOTENT_PG_RESTART restarts.
            let restart = std::env::var("IDEMPOTENT_PG_RESTART")
                .ok()
                .filter(|_| std::env::var("IDEMPOTENT_PG_URL").ok().as_deref() == Some(&upstream));
            let restarts = match restart {
                Some(restart) => alternate(faults, |i| {
                    format!("{restart} {}", ["immediate", "fast"][i % 2])
                }),
                None => {
                    notes.push("PostgreSQL behind PgBouncer is not the one IDEMPOTENT_PG_RESTART restarts, so this run restarts nothing".into());
                    vec![]
                }
            };
            (
                single("pgbouncer", &with_database(&bouncer, &database)),
                restarts,
                Check::Url(direct),
                false,
            )
        }
        "postgres-ha-sync" | "postgres-ha-async" => {
            let ctl = env(
                "IDEMPOTENT_PG_HA_CTL",
                "start the pair with scripts/postgres-ha",
            );
            let mode = backend.rsplit('-').next().unwrap();
            // A fresh pair in this run's mode.
            let started = script(&format!("{ctl} start {mode}"));
            let urls = started
                .lines()
                .find_map(|line| line.strip_prefix("export IDEMPOTENT_PG_HA_URLS="))
                .expect("the pair's URLs")
                .to_owned();
            let urls: Vec<&str> = urls.split(',').collect();
            let primary = fresh_postgres_database(urls[0]).await;
            let database = primary.rsplit_once('/').unwrap().1.to_owned();
            let both: Vec<String> = urls
                .iter()
                .map(|url| with_database(url, &database))
                .collect();
            // In async mode the standby lags a second behind when the primary dies.
            let lag = if mode == "async" { " 1" } else { "" };
            (
                single("postgres-ha", &both.join(",")),
                alternate(faults, |_| format!("{ctl} failover{lag}")),
                Check::Primary { ctl, database },
                false,
            )
        }
        "mysql" => {
            let base = env(
                "IDEMPOTENT_MYSQL_URL",
                "run the tests with scripts/test, which starts MariaDB",
            );
            let url = fresh_mysql_database(&[base]).await.remove(0);
            if faults > 0 {
                notes.push("a single MariaDB is not restarted by this run".into());
            }
            (single("mysql", &url), vec![], Check::Url(url), false)
        }
        "galera" => {
            let urls = env(
                "IDEMPOTENT_GALERA_URLS",
                "start the cluster with scripts/galera",
            );
            let ctl = env(
                "IDEMPOTENT_GALERA_CTL",
                "start the cluster with scripts/galera",
            );
            let nodes: Vec<String> = urls.split(',').map(str::to_owned).collect();
            let nodes = fresh_mysql_database(&nodes).await;
            // Consumer i's own node is node i mod `spread`; the others are where it goes while its
            // own is down.
            let targets = (0..spread.clamp(1, nodes.len()))
                .map(|own| {
                    let order: Vec<&str> = (0..nodes.len())
                        .map(|i| nodes[(own + i) % nodes.len()].as_str())
                        .collect();
                    ("galera".to_owned(), order.join(","))
                })
                .collect();
            // One node at a time, each restart waits until the node has caught up.
            let restarts = alternate(faults, |i| {
                format!(
                    "{ctl} restart {} {}",
                    i % 3 + 1,
                    ["immediate", "fast"][i / 3 % 2]
                )
            });
            (targets, restarts, Check::Url(nodes[0].clone()), true)
        }
        "sqlite" => {
            let temp = tempfile::tempdir().expect("a temporary folder");
            let url = format!("sqlite://{}", temp.path().join("chaos.db").display());
            dir = Some(temp);
            (single("sqlite", &url), vec![], Check::Url(url), false)
        }
        other => panic!("unknown backend {other}"),
    };
    let check_url = match &check {
        Check::Url(url) => url.clone(),
        Check::Primary { .. } => check.url(),
    };
    setup(&check_url).await;
    if backend == "galera" {
        // Every node has the tables before a consumer writes to them.
        let nodes: Vec<String> = targets[0].1.split(',').map(str::to_owned).collect();
        sync(&nodes).await;
    }
    Prepared {
        targets,
        faults: fault_commands,
        check,
        causal,
        notes,
        _dir: dir,
    }
}

fn alternate(faults: usize, command: impl Fn(usize) -> String) -> Vec<String> {
    (0..faults).map(command).collect()
}

async fn fresh_postgres_database(base: &str) -> String {
    let name = format!("chaos_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::PgConnection::connect(base).await.expect("PostgreSQL");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .expect("CREATE DATABASE");
    with_database(base, &name)
}

/// A fresh database on the server (or the cluster) of `nodes`; its URL on each node, once every
/// node has it.
async fn fresh_mysql_database(nodes: &[String]) -> Vec<String> {
    let name = format!("chaos_{}", uuid::Uuid::new_v4().simple());
    let mut admin = sqlx::MySqlConnection::connect(&nodes[0])
        .await
        .expect("MySQL");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .expect("CREATE DATABASE");
    sync(nodes).await;
    nodes
        .iter()
        .map(|node| with_database(node, &name))
        .collect()
}

/// On a Galera cluster (more than one node): returns once every node has applied what the cluster
/// committed so far.
async fn sync(nodes: &[String]) {
    if nodes.len() < 2 {
        return;
    }
    for node in nodes {
        let mut conn = sqlx::MySqlConnection::connect(node)
            .await
            .expect("a Galera node");
        sqlx::query("SET SESSION wsrep_sync_wait = 15")
            .execute(&mut conn)
            .await
            .unwrap();
        sqlx::query("SELECT 1").execute(&mut conn).await.unwrap();
    }
}

/// The run's tables, the inbox and the counter.
async fn setup(url: &str) {
    const TABLES: [&str; 4] = [
        "CREATE TABLE chaos_ledger (message_id TEXT NOT NULL, tag BIGINT NOT NULL)",
        "CREATE TABLE chaos_emails (message_id TEXT NOT NULL, tag BIGINT NOT NULL)",
        "CREATE TABLE chaos_counter (name TEXT PRIMARY KEY, value BIGINT NOT NULL)",
        "INSERT INTO chaos_counter (name, value) VALUES ('ledger', 0)",
    ];
    // Galera wants a primary key on every table it replicates.
    const MYSQL_TABLES: [&str; 4] = [
        "CREATE TABLE chaos_ledger (id BIGINT AUTO_INCREMENT PRIMARY KEY, message_id VARCHAR(64) NOT NULL, tag BIGINT NOT NULL)",
        "CREATE TABLE chaos_emails (id BIGINT AUTO_INCREMENT PRIMARY KEY, message_id VARCHAR(64) NOT NULL, tag BIGINT NOT NULL)",
        "CREATE TABLE chaos_counter (name VARCHAR(32) PRIMARY KEY, value BIGINT NOT NULL)",
        "INSERT INTO chaos_counter (name, value) VALUES ('ledger', 0)",
    ];
    if url.starts_with("postgres") {
        create(
            sqlx::PgPool::connect(url).await.expect("PostgreSQL"),
            &TABLES,
        )
        .await;
    } else if url.starts_with("mysql") {
        create(
            sqlx::MySqlPool::connect(url).await.expect("MySQL"),
            &MYSQL_TABLES,
        )
        .await;
    } else {
        let options = idempotent::sqlite::connect_options(url).unwrap();
        let pool = sqlx::SqlitePool::connect_with(options)
            .await
            .expect("SQLite");
        create(pool, &TABLES).await;
    }
}

async fn create<DB: idempotent::Backend>(pool: sqlx::Pool<DB>, tables: &[&'static str])
where
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
{
    for &statement in tables {
        sqlx::raw_sql(statement)
            .execute(&pool)
            .await
            .expect(statement);
    }
    idempotent::Inbox::new(pool)
        .migrate()
        .await
        .expect("migrate");
}
