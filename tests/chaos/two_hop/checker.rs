//! Proves what the two-hop run promised, from the databases' rows: every message's effect at A
//! happened once and wrote exactly one outgoing row, with the id derived from A's consumer and the
//! message's key; every outgoing message's effect at B happened once, none lost; and for each
//! ordering key, B processed the messages in the order A committed them.

use std::collections::{HashMap, HashSet};

use idempotent::outbox::Outbox;
use sqlx::PgPool;

use crate::driver::Outcome;

#[derive(Debug, Default)]
pub struct Verdict {
    pub a_double: Vec<String>,
    pub a_lost: Vec<String>,
    pub outbox_mismatches: Vec<String>,
    pub b_double: Vec<String>,
    pub b_lost: Vec<String>,
    pub out_of_order: Vec<String>,
    pub outbox_rows: usize,
    pub keys: usize,
}

impl Verdict {
    pub fn violations(&self) -> usize {
        self.a_double.len()
            + self.a_lost.len()
            + self.outbox_mismatches.len()
            + self.b_double.len()
            + self.b_lost.len()
            + self.out_of_order.len()
    }
}

pub async fn check(url: &str, outcome: &Outcome) -> Result<Verdict, sqlx::Error> {
    let pool = PgPool::connect(url).await?;
    let mut verdict = Verdict::default();
    let a: HashMap<String, i64> =
        sqlx::query_as("SELECT message_id, COUNT(*) FROM a_effects GROUP BY message_id")
            .fetch_all(&pool)
            .await?
            .into_iter()
            .collect();
    let rows: Vec<(String, i64, Option<String>)> = sqlx::query_as(
        "SELECT message_id, state, ordering_key FROM idempotent_inbox_outbox ORDER BY id",
    )
    .fetch_all(&pool)
    .await?;
    verdict.outbox_rows = rows.len();
    let b: HashMap<String, i64> =
        sqlx::query_as("SELECT message_id, COUNT(*) FROM b_effects GROUP BY message_id")
            .fetch_all(&pool)
            .await?
            .into_iter()
            .collect();

    let mut outgoing = HashSet::new();
    for message in &outcome.messages {
        match a.get(&message.id).copied().unwrap_or(0) {
            1 => {}
            0 => verdict.a_lost.push(message.id.clone()),
            n => verdict.a_double.push(format!("{} {n} times", message.id)),
        }
        let key = idempotent::message_key(&message.id).expect("a key");
        let id = Outbox::derived_id("a", &key, 0);
        match b.get(&id).copied().unwrap_or(0) {
            1 => {}
            0 => verdict.b_lost.push(format!("{id} (of {})", message.id)),
            n => verdict.b_double.push(format!("{id} {n} times")),
        }
        outgoing.insert((id, message.key.clone()));
    }
    let mut seen = HashSet::new();
    for (id, state, key) in &rows {
        if !seen.insert(id.clone()) {
            verdict
                .outbox_mismatches
                .push(format!("two outbox rows of {id}"));
        }
        if *state != 1 {
            verdict
                .outbox_mismatches
                .push(format!("{id} left in state {state}"));
        }
        if !outgoing.contains(&(id.clone(), key.clone().unwrap_or_default())) {
            verdict
                .outbox_mismatches
                .push(format!("an outbox row of no message: {id} {key:?}"));
        }
    }
    if rows.len() != outcome.messages.len() {
        verdict.outbox_mismatches.push(format!(
            "{} outbox rows for {} messages",
            rows.len(),
            outcome.messages.len()
        ));
    }
    for id in b.keys() {
        if !outgoing.iter().any(|(known, _)| known == id) {
            verdict
                .b_double
                .push(format!("an effect at B of no message: {id}"));
        }
    }

    // Per key, in B's processing order, A's commit numbers must run 1, 2, 3, … without a gap.
    let b_order: Vec<(String, i64, i64)> =
        sqlx::query_as("SELECT key, n, b_seq FROM b_effects ORDER BY key, b_seq")
            .fetch_all(&pool)
            .await?;
    let a_counts: HashMap<String, i64> = sqlx::query_as("SELECT key, n FROM a_keys")
        .fetch_all(&pool)
        .await?
        .into_iter()
        .collect();
    let mut per_key: HashMap<String, Vec<i64>> = HashMap::new();
    for (key, n, _) in b_order {
        per_key.entry(key).or_default().push(n);
    }
    verdict.keys = per_key.len();
    for (key, ns) in &per_key {
        let expected: Vec<i64> = (1..=a_counts.get(key).copied().unwrap_or(0)).collect();
        if *ns != expected {
            let first = ns
                .iter()
                .zip(&expected)
                .position(|(got, want)| got != want)
                .unwrap_or(ns.len().min(expected.len()));
            verdict.out_of_order.push(format!(
                "{key}: B saw A's commits in the order {:?}… (from position {first})",
                &ns[first.saturating_sub(2)..(first + 3).min(ns.len())]
            ));
        }
    }
    pool.close().await;
    Ok(verdict)
}
