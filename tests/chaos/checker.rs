//! Proves, for every message, what the run promised: each effect happened exactly once, nothing
//! acknowledged was lost, poison messages were never marked done, and the inbox holds exactly one
//! row per (consumer, key) that was processed and none other. It also counts, for every message
//! and consumer, whether the effect and the inbox row are there together, or missing together
//! ("both or neither", which a failover that loses commits must keep), and checks the counter the
//! ledger's effect increments against the ledger's rows.

use std::collections::{HashMap, HashSet};

use sqlx::AnyPool;

use crate::driver::Outcome;
use crate::protocol::{Behaviour, Target};

/// The checker's findings: every list empty means the run upheld the guarantee.
#[derive(Debug, Default)]
pub struct Verdict {
    pub double_effects: Vec<String>,
    pub lost: Vec<String>,
    pub poison_marked_done: Vec<String>,
    pub inbox_mismatches: Vec<String>,
    pub counter: (i64, i64),
    pub inbox_rows: usize,
    /// (message, consumer) pairs with both the effect and the inbox row, and with neither.
    pub both: usize,
    pub neither: usize,
    /// Pairs with one of the two: what "both or neither" forbids.
    pub half: Vec<String>,
    /// The ledger's counter against the ledger's rows: both committed in one transaction.
    pub counter_against_rows: (i64, i64),
}

impl Verdict {
    pub fn violations(&self) -> usize {
        self.double_effects.len()
            + self.lost.len()
            + self.poison_marked_done.len()
            + self.inbox_mismatches.len()
            + usize::from(self.counter.0 != self.counter.1)
            + self.consistency_violations()
    }

    /// Breaches of "both or neither": an effect without its inbox row or the other way round, a
    /// counter that disagrees with the ledger, an effect twice.
    pub fn consistency_violations(&self) -> usize {
        self.half.len()
            + self.double_effects.len()
            + usize::from(self.counter_against_rows.0 != self.counter_against_rows.1)
    }
}

fn consumer_name(target: Target) -> &'static str {
    match target {
        Target::Ledger => "ledger",
        Target::Mailer => "mailer",
    }
}

/// Checks the database at `url` against what the broker saw. `causal`: read with
/// `wsrep_sync_wait` (a Galera node).
pub async fn check(url: &str, causal: bool, outcome: &Outcome) -> Result<Verdict, sqlx::Error> {
    sqlx::any::install_default_drivers();
    let options = sqlx::any::AnyPoolOptions::new().max_connections(1);
    let options = if causal {
        options.after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::query("SET SESSION wsrep_sync_wait = 15")
                    .execute(conn)
                    .await
                    .map(drop)
            })
        })
    } else {
        options
    };
    let pool: AnyPool = options.connect(url).await?;
    let text = if url.starts_with("mysql") {
        "CHAR"
    } else {
        "TEXT"
    };
    let mut verdict = Verdict::default();

    let mut effects: HashMap<(String, Target), i64> = HashMap::new();
    for (target, table) in [
        (Target::Ledger, "chaos_ledger"),
        (Target::Mailer, "chaos_emails"),
    ] {
        let rows: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT message_id, COUNT(*) FROM {table} GROUP BY message_id"
        )))
        .fetch_all(&pool)
        .await?;
        for (id, count) in rows {
            effects.insert((id, target), count);
        }
    }
    let inbox: Vec<(String, Vec<u8>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT CAST(consumer AS {text}), message_key FROM idempotent_inbox
         WHERE consumer IN ('ledger', 'mailer')"
    )))
    .fetch_all(&pool)
    .await?;
    verdict.inbox_rows = inbox.len();
    let mut inbox_set: HashSet<(String, Vec<u8>)> = HashSet::new();
    for row in inbox {
        if !inbox_set.insert(row.clone()) {
            verdict
                .inbox_mismatches
                .push(format!("two inbox rows for {}", row.0));
        }
    }

    let mut expected_ledger = 0;
    for (index, message) in outcome.messages.iter().enumerate() {
        let key = idempotent::message_key(&message.id).expect("a UUID key");
        for target in [Target::Ledger, Target::Mailer] {
            let name = consumer_name(target);
            let count = effects
                .get(&(message.id.to_string(), target))
                .copied()
                .unwrap_or(0);
            let row = inbox_set.remove(&(name.to_owned(), key.as_bytes().to_vec()));
            let what = format!("{name} {} ({:?})", message.id, message.behaviour);
            match (count > 0, row) {
                (true, true) => verdict.both += 1,
                // A poison message is never done: its own check is below.
                (false, false) if message.behaviour != Behaviour::Poison => verdict.neither += 1,
                (false, false) => {}
                (true, false) => verdict
                    .half
                    .push(format!("{what}: an effect without its inbox row")),
                (false, true) => verdict
                    .half
                    .push(format!("{what}: an inbox row without its effect")),
            }
            if message.behaviour == Behaviour::Poison {
                if count != 0 || row {
                    verdict.poison_marked_done.push(what);
                } else if !outcome.dead_letters.contains(&(index, target)) {
                    verdict
                        .lost
                        .push(format!("{what}: neither done nor dead-lettered"));
                }
                continue;
            }
            if target == Target::Ledger {
                expected_ledger += 1;
            }
            if count > 1 {
                verdict
                    .double_effects
                    .push(format!("{what}: effect happened {count} times"));
            }
            if count == 0 {
                let acked = outcome.acked.contains(&(index, target));
                verdict.lost.push(format!(
                    "{what}: no effect{}",
                    if acked { ", though acknowledged" } else { "" }
                ));
            }
            if !row {
                verdict
                    .inbox_mismatches
                    .push(format!("{what}: no inbox row"));
            }
            if count >= 1 && !outcome.acked.contains(&(index, target)) {
                verdict
                    .lost
                    .push(format!("{what}: effect but never acknowledged"));
            }
        }
    }
    for (consumer, key) in inbox_set {
        verdict.inbox_mismatches.push(format!(
            "an inbox row for {consumer} of no message: {key:02x?}"
        ));
    }
    let counter: i64 = sqlx::query_scalar("SELECT value FROM chaos_counter WHERE name = 'ledger'")
        .fetch_one(&pool)
        .await?;
    verdict.counter = (counter, expected_ledger);
    let ledger_rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM chaos_ledger")
        .fetch_one(&pool)
        .await?;
    verdict.counter_against_rows = (counter, ledger_rows);
    pool.close().await;
    Ok(verdict)
}
