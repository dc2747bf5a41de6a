//! The producer and the chaos of the two-hop run: publishes every message to A's queue (a share of
//! them twice, as a retrying producer does), runs consumer A, the relays and consumer B as
//! processes, SIGKILLs each where it says it paused (and the relays at random moments too),
//! restarts them, restarts PostgreSQL at evenly spaced points of B's progress, and stops once B
//! has processed every message, the outbox is empty and both queues are drained.

use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use crate::roles::Payload;

/// What one run does.
#[derive(Debug, Clone)]
pub struct Config {
    pub pg: String,
    pub amqp: String,
    /// The Kafka cluster's servers, when the second hop is Kafka.
    pub kafka: Option<String>,
    pub restart: Option<String>,
    pub messages: usize,
    pub keys: usize,
    pub consumers_a: usize,
    pub relays: usize,
    /// The share of deliveries (and of publications) whose process stops at a crash point.
    pub kill_rate: f64,
    /// How often, on average, a relay is also killed at a random moment.
    pub relay_random_kill_every: Duration,
    pub db_restarts: usize,
    /// The share of messages the producer publishes twice.
    pub duplicate_share: f64,
    pub seed: u64,
    pub deadline: Duration,
}

/// One message the producer publishes.
pub struct Message {
    pub id: String,
    pub key: String,
}

/// The run's figures.
#[derive(Debug, Default)]
pub struct Figures {
    pub published: usize,
    pub producer_retries: usize,
    pub a_processed: usize,
    pub a_duplicates: usize,
    pub b_processed: usize,
    pub b_duplicates: usize,
    pub kills: BTreeMap<String, usize>,
    pub restarts: BTreeMap<String, usize>,
    pub unexpected_exits: usize,
    pub failures: Vec<String>,
    pub db_restarts: Vec<String>,
    pub elapsed: Duration,
}

pub struct Outcome {
    pub messages: Vec<Message>,
    pub figures: Figures,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Role {
    A,
    Relay,
    B,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::A => "consumer-a",
            Role::Relay => "relay",
            Role::B => "consumer-b",
        }
    }
}

struct Process {
    role: Role,
    child: Child,
    generation: u64,
    killed: bool,
}

enum Event {
    Line(String),
    Exited,
}

/// The queues of a new run: (A's, B's).
pub fn queues() -> (String, String) {
    let run = uuid::Uuid::new_v4().simple().to_string();
    (format!("chaos-a-{run}"), format!("chaos-b-{run}"))
}

async fn channel(amqp: &str) -> Result<(Connection, Channel), String> {
    let connection = Connection::connect(amqp, ConnectionProperties::default())
        .await
        .map_err(|e| format!("RabbitMQ: {e}"))?;
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| e.to_string())?;
    Ok((connection, channel))
}

/// Messages ready in `queue`, asked on a channel of its own.
async fn ready(connection: &Connection, queue: &str) -> u32 {
    let Ok(channel) = connection.create_channel().await else {
        return u32::MAX;
    };
    let declared = channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await;
    let _ = channel.close(200, "".into()).await;
    declared.map_or(u32::MAX, |q| q.message_count())
}

pub async fn run(config: &Config, queue_a: &str, queue_b: &str) -> Result<Outcome, String> {
    let started = Instant::now();
    let mut rng = StdRng::seed_from_u64(config.seed);
    let mut figures = Figures::default();
    let (connection, channel) = channel(&config.amqp).await?;
    for queue in [queue_a, queue_b] {
        channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| e.to_string())?;
    }
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|e| e.to_string())?;

    let messages: Vec<Message> = (0..config.messages)
        .map(|_| Message {
            id: uuid::Uuid::new_v4().to_string(),
            key: format!("order-{}", rng.random_range(0..config.keys)),
        })
        .collect();
    // Published before the consumers start: a copy right behind its first for a share of them.
    let mut confirms = Vec::new();
    for message in &messages {
        let copies = if rng.random_bool(config.duplicate_share) {
            figures.producer_retries += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let payload = serde_json::to_vec(&Payload {
                key: message.key.clone(),
                n: 0,
            })
            .unwrap();
            let confirm = channel
                .basic_publish(
                    "".into(),
                    queue_a.into(),
                    BasicPublishOptions::default(),
                    &payload,
                    BasicProperties::default()
                        .with_message_id(message.id.as_str().into())
                        .with_delivery_mode(2),
                )
                .await
                .map_err(|e| e.to_string())?;
            confirms.push(confirm);
            figures.published += 1;
        }
    }
    for confirm in confirms {
        confirm.await.map_err(|e| e.to_string())?;
    }

    let (events_tx, mut events) = mpsc::unbounded_channel::<(usize, u64, Event)>();
    let roles: Vec<Role> = std::iter::repeat_n(Role::A, config.consumers_a)
        .chain(std::iter::repeat_n(Role::Relay, config.relays))
        .chain(std::iter::once(Role::B))
        .collect();
    let mut processes = Vec::new();
    for (slot, role) in roles.iter().enumerate() {
        processes.push(spawn(config, *role, slot, 0, queue_a, queue_b, &events_tx)?);
    }

    let pg = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy(&config.pg)
        .map_err(|e| e.to_string())?;
    let mut restarts_done = 0usize;
    let mut restart: Option<tokio::task::JoinHandle<Result<(), String>>> = None;
    let mut checked = Instant::now();
    let mut done_since: Option<Instant> = None;
    // Rolled every 50 ms for each relay.
    let relay_kill_chance =
        (0.05 / config.relay_random_kill_every.as_secs_f64().max(0.05)).min(1.0);
    let mut rolled = Instant::now();
    loop {
        if started.elapsed() > config.deadline {
            return Err(format!(
                "the run did not finish within {:?} ({} of {} messages through B)",
                config.deadline, figures.b_processed, config.messages
            ));
        }
        // Every 50 ms or on an event.
        let event = tokio::select! {
            event = events.recv() => event,
            () = tokio::time::sleep(Duration::from_millis(50)) => None,
        };
        if let Some((slot, generation, event)) = event
            && processes[slot].generation == generation
        {
            let process = &mut processes[slot];
            match event {
                Event::Line(line) => {
                    let words: Vec<&str> = line.split_whitespace().collect();
                    match words.as_slice() {
                        ["PAUSED", role, point] if !process.killed => {
                            process.killed = true;
                            *figures.kills.entry(format!("{role} {point}")).or_default() += 1;
                            let _ = process.child.start_kill();
                        }
                        ["A", _, "processed"] => figures.a_processed += 1,
                        ["A", _, "duplicate"] => figures.a_duplicates += 1,
                        ["B", _, "processed"] => figures.b_processed += 1,
                        ["B", _, "duplicate"] => figures.b_duplicates += 1,
                        ["FAILED", ..] => figures.failures.push(line.clone()),
                        _ => {}
                    }
                }
                Event::Exited => {
                    if !process.killed {
                        figures.unexpected_exits += 1;
                    }
                    let _ = process.child.wait().await;
                    let role = process.role;
                    *figures.restarts.entry(role.name().to_owned()).or_default() += 1;
                    processes[slot] = spawn(
                        config,
                        role,
                        slot,
                        generation + 1,
                        queue_a,
                        queue_b,
                        &events_tx,
                    )?;
                }
            }
        }
        // A relay killed at a random moment: in a batch's statements, its commit, or idle.
        let roll = rolled.elapsed() >= Duration::from_millis(50);
        if roll {
            rolled = Instant::now();
        }
        for process in processes.iter_mut() {
            if roll
                && process.role == Role::Relay
                && !process.killed
                && rng.random_bool(relay_kill_chance)
            {
                process.killed = true;
                *figures.kills.entry("relay at-random".into()).or_default() += 1;
                let _ = process.child.start_kill();
            }
        }
        // PostgreSQL restarts at evenly spaced points of B's progress.
        if let Some(command) = &config.restart {
            let due = (restarts_done + 1) * config.messages / (config.db_restarts + 1);
            if restarts_done < config.db_restarts && figures.b_processed >= due && restart.is_none()
            {
                let mode = if restarts_done.is_multiple_of(2) {
                    "immediate"
                } else {
                    "fast"
                };
                figures.db_restarts.push(format!(
                    "{mode} at {} messages through B",
                    figures.b_processed
                ));
                restarts_done += 1;
                let command = format!("{command} {mode}");
                restart = Some(tokio::spawn(async move {
                    let status = Command::new("sh")
                        .arg("-c")
                        .arg(&command)
                        .stdout(Stdio::null())
                        .status()
                        .await;
                    match status {
                        Ok(s) if s.success() => Ok(()),
                        other => Err(format!("`{command}` failed: {other:?}")),
                    }
                }));
            }
        }
        if restart.as_ref().is_some_and(|r| r.is_finished()) {
            restart.take().unwrap().await.map_err(|e| e.to_string())??;
        }
        if !figures.failures.is_empty() {
            return Err(format!("a consumer failed: {:?}", figures.failures));
        }
        // Done: every message through B, nothing left to publish, both queues drained.
        if checked.elapsed() < Duration::from_millis(250) || restart.is_some() {
            continue;
        }
        checked = Instant::now();
        let through: Result<(i64, i64), sqlx::Error> = sqlx::query_as(
            "SELECT (SELECT COUNT(DISTINCT message_id) FROM b_effects),
                    (SELECT COUNT(*) FROM idempotent_inbox_outbox WHERE state <> 1)",
        )
        .fetch_one(&pg)
        .await;
        let Ok((through_b, unsent)) = through else {
            continue;
        };
        let drained = ready(&connection, queue_a).await == 0
            && ready(&connection, queue_b).await == 0
            && b_committed(config, queue_b).await;
        if through_b as usize == config.messages && unsent == 0 && drained {
            match done_since {
                // Still so a second later: nothing was in flight.
                Some(since) if since.elapsed() >= Duration::from_secs(1) => break,
                Some(_) => {}
                None => done_since = Some(Instant::now()),
            }
        } else {
            done_since = None;
        }
    }
    for mut process in processes {
        process.killed = true;
        let _ = process.child.start_kill();
        let _ = process.child.wait().await;
    }
    figures.elapsed = started.elapsed();
    let _ = connection.close(200, "".into()).await;
    Ok(Outcome { messages, figures })
}

/// Whether B committed everything on Kafka (always, when the second hop is RabbitMQ: its queue's
/// ready count says it).
async fn b_committed(config: &Config, topic: &str) -> bool {
    match &config.kafka {
        #[cfg(feature = "kafka")]
        Some(servers) => crate::kafka::drained(servers, topic).await,
        _ => true,
    }
}

/// Starts the process of `role` in `slot`, and a task that forwards its stdout lines and its exit.
fn spawn(
    config: &Config,
    role: Role,
    slot: usize,
    generation: u64,
    queue_a: &str,
    queue_b: &str,
    events: &mpsc::UnboundedSender<(usize, u64, Event)>,
) -> Result<Process, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let seed = config.seed.wrapping_add(slot as u64 * 1000 + generation);
    let mut command = Command::new(exe);
    command.env("CHAOS_B_QUEUE", queue_b);
    if let Some(servers) = &config.kafka {
        command.env("CHAOS_KAFKA", servers);
    }
    match role {
        Role::A => command.args(["consume-a", queue_a]),
        Role::B => command.args(["consume-b", queue_b]),
        Role::Relay => command.args(["relay", "-"]),
    };
    let mut child = command
        .args([
            config.pg.as_str(),
            config.amqp.as_str(),
            &config.kill_rate.to_string(),
            &seed.to_string(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", role.name()))?;
    let stdout = child.stdout.take().expect("piped");
    let events = events.clone();
    tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let _ = events.send((slot, generation, Event::Line(line)));
        }
        let _ = events.send((slot, generation, Event::Exited));
    });
    Ok(Process {
        role,
        child,
        generation,
        killed: false,
    })
}
