//! What the commands print: aligned tables for people, JSON (one document) for scripts.

use std::time::SystemTime;

use idempotent::outbox::{HeldKey, OutboxRecord, OutboxStats};
use idempotent::{
    AuditEntry, ConsumerStats, Expired, MessageKey, Migration, Page, PurgeReport, Record,
    StuckCall, TableName,
};
use serde_json::{Value, json};

use crate::args::rfc3339;

/// How to print.
#[derive(Clone, Copy)]
pub(crate) struct Output {
    pub(crate) json: bool,
    /// Which of several databases the lines are of (`migrate` with several `--url`): the index of
    /// its `--url`, from 1.
    pub(crate) database: Option<usize>,
}

pub(crate) fn time(time: Option<SystemTime>) -> Value {
    time.map_or(Value::Null, |t| Value::String(rfc3339(t)))
}

fn text(time: Option<SystemTime>) -> String {
    time.map_or_else(|| "-".to_owned(), rfc3339)
}

/// The key's components as a person reads them (`"order-7"`, `("a", 5)`), when its stored form
/// still has them; a hashed key shows as such.
pub(crate) fn readable(key: &MessageKey) -> String {
    let mut bytes = key.as_bytes();
    if key.is_hashed() {
        return "(hashed)".to_owned();
    }
    let mut parts = Vec::new();
    while let Some((&tag, rest)) = bytes.split_first() {
        bytes = rest;
        let part = match tag {
            0x01 | 0x02 => {
                let mut len = 0usize;
                let mut shift = 0;
                loop {
                    let Some((&b, rest)) = bytes.split_first() else {
                        return "?".to_owned();
                    };
                    bytes = rest;
                    len |= usize::from(b & 0x7F) << shift;
                    shift += 7;
                    if b & 0x80 == 0 {
                        break;
                    }
                }
                let Some((value, rest)) = bytes.split_at_checked(len) else {
                    return "?".to_owned();
                };
                bytes = rest;
                match (tag, std::str::from_utf8(value)) {
                    (0x01, Ok(text)) => format!("{text:?}"),
                    _ => format!(
                        "bytes:{}",
                        MessageKey::from_stored(value.to_vec())
                            .map_or_else(|_| String::new(), |k| k.to_string())
                    ),
                }
            }
            0x03..=0x05 => {
                let Some((value, rest)) = bytes.split_at_checked(16) else {
                    return "?".to_owned();
                };
                bytes = rest;
                let array: [u8; 16] = value.try_into().expect("16 bytes");
                match tag {
                    0x03 => u128::from_be_bytes(array).to_string(),
                    0x04 => i128::from_be_bytes(array).to_string(),
                    _ => uuid::Uuid::from_bytes(array).to_string(),
                }
            }
            _ => return "?".to_owned(),
        };
        parts.push(part);
    }
    match parts.as_slice() {
        [one] => one.clone(),
        _ => format!("({})", parts.join(", ")),
    }
}

/// Prints `rows` under `headers`, each column as wide as its widest cell.
pub(crate) fn table(headers: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        println!("{}", padded.join("  ").trim_end());
    };
    line(headers.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

pub(crate) fn print_json(value: Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(&value).expect("JSON values serialize")
    );
}

fn fingerprint(record: &Record) -> Option<String> {
    record
        .fingerprint
        .as_ref()
        .and_then(|f| MessageKey::from_stored(f.clone()).ok())
        .map(|f| f.to_string())
}

fn record_json(record: &Record) -> Value {
    json!({
        "key": record.key.to_string(),
        "key_readable": readable(&record.key),
        "processed_at": rfc3339(record.processed_at),
        "fingerprint": fingerprint(record),
        "response_bytes": record.response_len,
    })
}

impl Output {
    pub(crate) fn ddl(&self, statements: &[String]) {
        if self.json {
            print_json(json!({ "statements": statements }));
        } else {
            for statement in statements {
                println!("{statement};\n");
            }
        }
    }

    pub(crate) fn migration(&self, table: &TableName, migration: Migration) {
        if self.json {
            print_json(json!({
                "url": self.database,
                "schema": table.schema(),
                "table": table.as_str(),
                "from": migration.from,
                "to": migration.to,
            }));
            return;
        }
        let url = self
            .database
            .map(|n| format!("--url #{n}: "))
            .unwrap_or_default();
        if migration.from == migration.to {
            println!(
                "{url}{table}: schema version {}, nothing to do",
                migration.to
            );
        } else {
            println!(
                "{url}{table}: schema version {} -> {}",
                migration.from, migration.to
            );
        }
    }

    pub(crate) fn stats(&self, stats: &[ConsumerStats]) {
        if self.json {
            let consumers: Vec<Value> = stats
                .iter()
                .map(|s| {
                    json!({
                        "consumer": s.consumer,
                        "rows": s.rows,
                        "oldest": time(s.oldest),
                        "horizon": time(s.horizon),
                        "pending_calls": s.pending_calls,
                        "stuck_calls": s.stuck_calls,
                    })
                })
                .collect();
            return print_json(json!({ "consumers": consumers }));
        }
        let rows: Vec<Vec<String>> = stats
            .iter()
            .map(|s| {
                vec![
                    s.consumer.clone(),
                    s.rows.to_string(),
                    text(s.oldest),
                    text(s.horizon),
                    s.pending_calls.to_string(),
                    s.stuck_calls.to_string(),
                ]
            })
            .collect();
        table(
            &[
                "CONSUMER",
                "ROWS",
                "OLDEST",
                "HORIZON",
                "PENDING CALLS",
                "STUCK CALLS",
            ],
            &rows,
        );
    }

    pub(crate) fn record(&self, consumer: &str, record: &Record) {
        if self.json {
            let mut value = record_json(record);
            value["consumer"] = json!(consumer);
            return print_json(value);
        }
        let response = record
            .response_len
            .map_or_else(|| "none".to_owned(), |n| format!("{n} bytes"));
        let rows = vec![
            vec!["consumer".to_owned(), consumer.to_owned()],
            vec!["key".to_owned(), readable(&record.key)],
            vec!["stored key".to_owned(), record.key.to_string()],
            vec!["processed at".to_owned(), rfc3339(record.processed_at)],
            vec![
                "fingerprint".to_owned(),
                fingerprint(record).unwrap_or_else(|| "none".to_owned()),
            ],
            vec!["response".to_owned(), response],
        ];
        table(&["FIELD", "VALUE"], &rows);
    }

    pub(crate) fn page(&self, consumer: &str, page: &Page) {
        let next = page.next.as_ref().map(ToString::to_string);
        if self.json {
            let records: Vec<Value> = page.records.iter().map(record_json).collect();
            return print_json(json!({ "consumer": consumer, "records": records, "next": next }));
        }
        let rows: Vec<Vec<String>> = page
            .records
            .iter()
            .map(|r| {
                vec![
                    rfc3339(r.processed_at),
                    readable(&r.key),
                    r.key.to_string(),
                    if r.fingerprint.is_some() { "yes" } else { "no" }.to_owned(),
                    r.response_len
                        .map_or_else(|| "-".to_owned(), |n| n.to_string()),
                ]
            })
            .collect();
        table(
            &[
                "PROCESSED AT",
                "KEY",
                "STORED KEY",
                "FINGERPRINT",
                "RESPONSE BYTES",
            ],
            &rows,
        );
        if let Some(next) = next {
            println!("\nmore: --after {next}");
        }
    }

    pub(crate) fn stuck(&self, calls: &[StuckCall]) {
        if self.json {
            let calls: Vec<Value> = calls
                .iter()
                .map(|c| {
                    json!({
                        "consumer": c.consumer,
                        "key": c.key.to_string(),
                        "key_readable": readable(&c.key),
                        "call": c.name,
                        "fence": c.fence,
                        "lease_expired_at": rfc3339(c.lease_expired_at),
                        "expired_for_seconds": c.expired_for.as_secs_f64(),
                    })
                })
                .collect();
            return print_json(json!({ "stuck_calls": calls }));
        }
        let rows: Vec<Vec<String>> = calls
            .iter()
            .map(|c| {
                vec![
                    c.consumer.clone(),
                    readable(&c.key),
                    c.name.clone(),
                    c.fence.to_string(),
                    rfc3339(c.lease_expired_at),
                ]
            })
            .collect();
        table(
            &["CONSUMER", "KEY", "CALL", "FENCE", "LEASE EXPIRED AT"],
            &rows,
        );
    }

    pub(crate) fn forgotten(&self, consumer: &str, key: &MessageKey) {
        if self.json {
            print_json(json!({ "consumer": consumer, "key": key.to_string(), "forgotten": true }));
        } else {
            println!(
                "{consumer}: forgot {} (audit digest {}); its next delivery is processed again",
                readable(key),
                key.full_digest()
            );
        }
    }

    pub(crate) fn audit(&self, entries: &[AuditEntry]) {
        if self.json {
            let entries: Vec<Value> = entries
                .iter()
                .map(|e| {
                    json!({
                        "consumer": e.consumer,
                        "key_digest": e.key_digest,
                        "reason": e.reason,
                        "processed_at": time(e.processed_at),
                        "forgotten_at": rfc3339(e.forgotten_at),
                    })
                })
                .collect();
            return print_json(json!({ "audit": entries }));
        }
        let rows: Vec<Vec<String>> = entries
            .iter()
            .map(|e| {
                vec![
                    rfc3339(e.forgotten_at),
                    e.consumer.clone(),
                    e.key_digest.clone(),
                    text(e.processed_at),
                    e.reason.clone(),
                ]
            })
            .collect();
        table(
            &[
                "FORGOTTEN AT",
                "CONSUMER",
                "KEY DIGEST",
                "PROCESSED AT",
                "REASON",
            ],
            &rows,
        );
    }

    pub(crate) fn preview(&self, expired: &[Expired]) {
        if self.json {
            let consumers: Vec<Value> = expired
                .iter()
                .map(|e| json!({ "consumer": e.consumer, "rows": e.rows, "calls": e.calls, "audit": e.audit }))
                .collect();
            return print_json(json!({ "dry_run": true, "consumers": consumers }));
        }
        let rows: Vec<Vec<String>> = expired
            .iter()
            .map(|e| {
                vec![
                    e.consumer.clone(),
                    e.rows.to_string(),
                    e.calls.to_string(),
                    e.audit.to_string(),
                ]
            })
            .collect();
        println!("dry run: nothing deleted");
        table(&["CONSUMER", "ROWS", "CALLS", "AUDIT"], &rows);
    }

    pub(crate) fn purged(&self, report: &PurgeReport) {
        if self.json {
            return print_json(json!({
                "dry_run": false,
                "locked_elsewhere": report.locked_elsewhere,
                "rows": report.deleted,
                "calls": report.calls_deleted,
                "audit": report.audit_deleted,
                "outbox": report.outbox_deleted,
                "batches": report.batches,
            }));
        }
        if report.locked_elsewhere {
            println!("another instance is purging these tables: nothing done");
        } else {
            println!(
                "deleted {} rows, {} call records, {} audit rows and {} sent outgoing messages in {} batches",
                report.deleted,
                report.calls_deleted,
                report.audit_deleted,
                report.outbox_deleted,
                report.batches
            );
        }
    }

    pub(crate) fn outbox_stats(&self, stats: &OutboxStats) {
        if self.json {
            return print_json(json!({
                "pending": stats.pending,
                "oldest_pending": time(stats.oldest_pending),
                "sent": stats.sent,
                "parked": stats.parked,
                "skipped": stats.skipped,
            }));
        }
        table(
            &["PENDING", "OLDEST PENDING", "SENT", "PARKED", "SKIPPED"],
            &[vec![
                stats.pending.to_string(),
                text(stats.oldest_pending),
                stats.sent.to_string(),
                stats.parked.to_string(),
                stats.skipped.to_string(),
            ]],
        );
    }

    pub(crate) fn outgoing(&self, records: &[OutboxRecord]) {
        if self.json {
            let records: Vec<Value> = records.iter().map(outgoing_json).collect();
            return print_json(json!({ "outgoing": records }));
        }
        let rows: Vec<Vec<String>> = records
            .iter()
            .map(|r| {
                vec![
                    r.row.to_string(),
                    r.state.as_str().to_owned(),
                    r.message_id.clone(),
                    destination(r),
                    r.origin.clone(),
                    r.ordering_key.clone().unwrap_or_else(|| "-".into()),
                    r.attempts.to_string(),
                    rfc3339(r.created_at),
                    r.last_error.clone().unwrap_or_else(|| "-".into()),
                ]
            })
            .collect();
        table(
            &[
                "ROW",
                "STATE",
                "MESSAGE ID",
                "DESTINATION",
                "ORIGIN",
                "ORDERING KEY",
                "ATTEMPTS",
                "WRITTEN AT",
                "LAST ERROR",
            ],
            &rows,
        );
    }

    pub(crate) fn held(&self, keys: &[HeldKey]) {
        if self.json {
            let keys: Vec<Value> = keys
                .iter()
                .map(|k| {
                    json!({
                        "ordering_key": k.ordering_key,
                        "parked": outgoing_json(&k.parked),
                        "waiting": k.waiting,
                        "oldest_waiting": time(k.oldest_waiting),
                    })
                })
                .collect();
            return print_json(json!({ "held": keys }));
        }
        let rows: Vec<Vec<String>> = keys
            .iter()
            .map(|k| {
                vec![
                    k.ordering_key.clone(),
                    k.parked.row.to_string(),
                    k.parked.message_id.clone(),
                    destination(&k.parked),
                    k.waiting.to_string(),
                    text(k.oldest_waiting),
                    k.parked.last_error.clone().unwrap_or_else(|| "-".into()),
                ]
            })
            .collect();
        table(
            &[
                "ORDERING KEY",
                "PARKED ROW",
                "MESSAGE ID",
                "DESTINATION",
                "WAITING",
                "OLDEST WAITING",
                "LAST ERROR",
            ],
            &rows,
        );
    }

    /// Kafka's held partitions.
    #[cfg(feature = "kafka")]
    pub(crate) fn held_partitions(&self, held: &[idempotent::broker::kafka::HeldPartition]) {
        if self.json {
            let held: Vec<Value> = held.iter().map(held_partition_json).collect();
            return print_json(json!({ "held": held }));
        }
        let rows: Vec<Vec<String>> = held
            .iter()
            .map(|h| {
                vec![
                    h.topic.clone(),
                    h.partition.to_string(),
                    h.offset.to_string(),
                    h.message_id.clone().unwrap_or_else(|| "-".into()),
                    h.attempts.to_string(),
                    text(h.held_since),
                    asked_text(h.asked.as_ref()),
                    h.reason.clone(),
                ]
            })
            .collect();
        table(
            &[
                "TOPIC",
                "PARTITION",
                "OFFSET",
                "MESSAGE ID",
                "ATTEMPTS",
                "HELD SINCE",
                "ASKED",
                "REASON",
            ],
            &rows,
        );
    }

    /// A command written for a Kafka held partition.
    #[cfg(feature = "kafka")]
    pub(crate) fn asked(&self, hold: &idempotent::broker::kafka::HeldPartition) {
        if self.json {
            return print_json(held_partition_json(hold));
        }
        println!(
            "asked to {} partition {} of {} (held at offset {}): its runner does it within moments, or the next one to run",
            asked_text(hold.asked.as_ref()),
            hold.partition,
            hold.topic,
            hold.offset
        );
    }

    pub(crate) fn retried(&self, row: i64) {
        if self.json {
            print_json(json!({ "row": row, "retried": true }));
        } else {
            println!("row {row} is pending again: the next relay batch publishes it");
        }
    }

    pub(crate) fn skipped(&self, row: i64) {
        if self.json {
            print_json(json!({ "row": row, "skipped": true }));
        } else {
            println!(
                "row {row} is skipped: it will not be published, and its ordering key goes on"
            );
        }
    }
}

/// A Kafka held partition as `--json` prints it.
#[cfg(feature = "kafka")]
fn held_partition_json(h: &idempotent::broker::kafka::HeldPartition) -> Value {
    json!({
        "topic": h.topic,
        "partition": h.partition,
        "offset": h.offset,
        "message_id": h.message_id,
        "reason": h.reason,
        "attempts": h.attempts,
        "held_since": time(h.held_since),
        "hold": h.hold,
        "asked": h.asked.as_ref().map(|asked| asked_text(Some(asked))),
    })
}

/// What an operator asked for a Kafka hold, in words.
#[cfg(feature = "kafka")]
fn asked_text(asked: Option<&idempotent::broker::kafka::Asked>) -> String {
    use idempotent::broker::kafka::Asked;
    match asked {
        None => "-".into(),
        Some(Asked::Retry) => "retry".into(),
        Some(Asked::Skip { reason }) => format!("skip: {reason}"),
    }
}

/// An outgoing message as `--json` prints it.
fn outgoing_json(r: &OutboxRecord) -> Value {
    json!({
        "row": r.row,
        "message_id": r.message_id,
        "exchange": r.destination.exchange,
        "routing_key": r.destination.routing_key,
        "origin": r.origin,
        "ordering_key": r.ordering_key,
        "state": r.state.as_str(),
        "attempts": r.attempts,
        "created_at": rfc3339(r.created_at),
        "sent_at": time(r.sent_at),
        "last_error": r.last_error,
        "payload_bytes": r.payload_len,
    })
}

/// Where an outgoing message goes, as a person reads it: `exchange / routing key`, or the queue or
/// subject alone.
fn destination(r: &OutboxRecord) -> String {
    match r.destination.exchange.as_str() {
        "" => r.destination.routing_key.clone(),
        exchange => format!("{exchange} / {}", r.destination.routing_key),
    }
}
