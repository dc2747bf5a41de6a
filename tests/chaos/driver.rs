//! The broker and the chaos: publishes every message at least once (some twice by a producer retry,
//! some as two copies at the same moment, some again from the dead-letter queue later), hands
//! deliveries to consumer processes, redelivers what was not acknowledged, SIGKILLs consumers at
//! their crash points and restarts them, and runs the database's faults mid-run (a restart, a
//! node killed and restarted, a failover), each a command of `scripts/`.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::process::Stdio;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::mpsc;
use uuid::Uuid;

use crate::protocol::{Behaviour, CRASH_POINTS, CrashPoint, Delivery, Reply, Target};

/// What one run does.
#[derive(Debug, Clone)]
pub struct Config {
    /// What each consumer process connects to: a kind of server and its URLs (see
    /// `consumer::run`), one per consumer, cycled.
    pub targets: Vec<(String, String)>,
    /// Shell commands that break the database (a restart, a node killed and restarted, a
    /// failover), run one at a time at evenly spaced points of the run's progress.
    pub faults: Vec<String>,
    pub messages: usize,
    pub consumers: usize,
    /// Deliveries one consumer handles at once.
    pub prefetch: usize,
    /// The share of deliveries whose consumer is killed at one of the crash points.
    pub kill_rate: f64,
    /// The share of messages published more than once.
    pub duplicate_share: f64,
    pub seed: u64,
    pub deadline: Duration,
    /// Print the acknowledgements and retryable nacks of every second.
    pub progress: bool,
}

/// What the broker publishes.
pub enum Plan<'a> {
    /// New messages, some published more than once.
    Chaos,
    /// These messages again, each once to each consumer: a producer that publishes everything
    /// again (after a failover that lost acknowledged work).
    Republish(&'a [Message]),
}

/// One message and what its handlers do with it.
#[derive(Debug, Clone, Copy)]
pub struct Message {
    pub id: Uuid,
    pub behaviour: Behaviour,
}

/// Why a copy of a message is in the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Why {
    First,
    ProducerRetry,
    ConcurrentCopy,
    Resubmitted,
    Redelivered,
    Republished,
}

#[derive(Debug, Clone)]
struct Publication {
    msg: usize,
    target: Target,
    why: Why,
    /// Dispatch this one together with the next, to two different consumers.
    paired: bool,
}

struct InFlight {
    publication: Publication,
}

struct Consumer {
    child: Child,
    stdin: ChildStdin,
    in_flight: HashMap<u64, InFlight>,
    generation: u64,
    killed: bool,
}

enum Event {
    Line(String),
    Exited,
}

/// The run's figures.
#[derive(Debug, Default)]
pub struct Figures {
    pub published: BTreeMap<String, usize>,
    pub deliveries: usize,
    pub processed: usize,
    pub duplicates_reported: usize,
    pub nacks_retryable: usize,
    pub nacks_failed: usize,
    /// Failures that are not retryable for messages whose handler always succeeds: an error the
    /// inbox misclassified.
    pub unexpected_failures: usize,
    pub dead_lettered: usize,
    pub kills: BTreeMap<CrashPoint, usize>,
    pub consumer_restarts: usize,
    pub unexpected_exits: usize,
    /// The database's faults that ran, and when.
    pub faults: Vec<String>,
    pub elapsed: Duration,
}

/// What the broker knows at the end: the messages, and which (message, target) it saw acknowledged
/// or dead-lettered.
pub struct Outcome {
    pub messages: Vec<Message>,
    pub acked: HashSet<(usize, Target)>,
    pub dead_letters: HashSet<(usize, Target)>,
    pub figures: Figures,
}

const TARGETS: [Target; 2] = [Target::Ledger, Target::Mailer];
const MAX_HANDLER_FAILURES: u32 = 4;

pub async fn run(config: &Config, plan: Plan<'_>) -> Result<Outcome, String> {
    let started = Instant::now();
    let mut rng = StdRng::seed_from_u64(config.seed);
    let mut figures = Figures::default();

    let mut queue = VecDeque::new();
    let mut later = Vec::new();
    let publish = |figures: &mut Figures, queue: &mut VecDeque<Publication>, p: Publication| {
        *figures.published.entry(format!("{:?}", p.why)).or_default() += 1;
        queue.push_back(p);
    };
    let messages: Vec<Message> = match plan {
        Plan::Republish(messages) => {
            for msg in 0..messages.len() {
                for target in TARGETS {
                    let p = Publication {
                        msg,
                        target,
                        why: Why::Republished,
                        paired: false,
                    };
                    publish(&mut figures, &mut queue, p);
                }
            }
            messages.to_vec()
        }
        Plan::Chaos => (0..config.messages)
            .map(|_| Message {
                // A version 4 UUID (never read as a UUIDv7 that says when it was sent).
                id: uuid::Builder::from_random_bytes(rng.random()).into_uuid(),
                behaviour: match rng.random_range(0..100) {
                    0 => Behaviour::Poison,
                    1..=4 => Behaviour::FailOnce,
                    _ => Behaviour::Succeed,
                },
            })
            .collect(),
    };

    // The publication plan: every message to both consumers, and for a share of them a duplicate,
    // by a producer retry (right behind it), as two copies at once, or from the dead-letter queue
    // after everything else.
    let fresh = if queue.is_empty() { messages.len() } else { 0 };
    for msg in 0..fresh {
        let duplicate = rng.random_bool(config.duplicate_share);
        let kind = rng.random_range(0..3);
        for target in TARGETS {
            let first = Publication {
                msg,
                target,
                why: Why::First,
                paired: duplicate && kind == 1,
            };
            publish(&mut figures, &mut queue, first);
            if !duplicate {
                continue;
            }
            let why = [Why::ProducerRetry, Why::ConcurrentCopy, Why::Resubmitted][kind];
            let copy = Publication {
                msg,
                target,
                why,
                paired: false,
            };
            if why == Why::Resubmitted {
                *figures.published.entry("Resubmitted".into()).or_default() += 1;
                later.push(copy);
            } else {
                publish(&mut figures, &mut queue, copy);
            }
        }
    }
    let expected_acks = queue.len() + later.len();

    let (events_tx, mut events) = mpsc::unbounded_channel::<(usize, u64, Event)>();
    let mut consumers = Vec::new();
    for slot in 0..config.consumers {
        consumers.push(spawn(config, slot, 0, &events_tx)?);
    }

    let mut delayed: Vec<(Instant, Publication)> = Vec::new();
    let mut attempts: HashMap<(usize, Target), u32> = HashMap::new();
    let mut failures: HashMap<(usize, Target), u32> = HashMap::new();
    let mut acked = HashSet::new();
    let mut dead_letters = HashSet::new();
    let mut dead_letter_queue: Vec<Publication> = Vec::new();
    let mut next_tag = 0u64;
    let mut acks = 0usize;
    let mut faults_done = 0usize;
    let mut fault: Option<tokio::task::JoinHandle<Result<(), String>>> = None;
    let mut resubmitted = false;
    let mut last_progress = Instant::now();

    loop {
        if started.elapsed() > config.deadline {
            return Err(format!(
                "the run did not finish within {:?}: {} queued, {} delayed, {} in flight",
                config.deadline,
                queue.len(),
                delayed.len(),
                consumers.iter().map(|c| c.in_flight.len()).sum::<usize>()
            ));
        }
        let now = Instant::now();
        delayed.retain(|(due, p)| {
            if *due <= now {
                queue.push_back(p.clone());
                false
            } else {
                true
            }
        });

        // Hand out deliveries while consumers have room; a pair goes to two consumers at once.
        while let Some(front) = queue.front() {
            let mut free: Vec<usize> = (0..consumers.len())
                .filter(|&i| !consumers[i].killed && consumers[i].in_flight.len() < config.prefetch)
                .collect();
            let needed = if front.paired && queue.len() > 1 {
                2
            } else {
                1
            };
            if free.len() < needed {
                break;
            }
            free.sort_by_key(|&i| consumers[i].in_flight.len());
            for &slot in free.iter().take(needed) {
                let publication = queue.pop_front().expect("checked above");
                next_tag += 1;
                let attempt = attempts
                    .entry((publication.msg, publication.target))
                    .or_default();
                *attempt += 1;
                let crash_at = rng
                    .random_bool(config.kill_rate)
                    .then(|| CRASH_POINTS[rng.random_range(0..CRASH_POINTS.len())]);
                let delivery = Delivery {
                    tag: next_tag,
                    target: publication.target,
                    message_id: messages[publication.msg].id,
                    behaviour: messages[publication.msg].behaviour,
                    attempt: *attempt,
                    crash_at,
                };
                let consumer = &mut consumers[slot];
                consumer
                    .in_flight
                    .insert(next_tag, InFlight { publication });
                figures.deliveries += 1;
                // A consumer that died since is noticed through its exit event.
                let _ = consumer
                    .stdin
                    .write_all(format!("{delivery}\n").as_bytes())
                    .await;
            }
        }

        // The database's faults, at evenly spaced points of progress, one at a time.
        let due = (faults_done + 1) * expected_acks / (config.faults.len() + 1);
        if faults_done < config.faults.len() && acks >= due && fault.is_none() {
            let command = config.faults[faults_done].clone();
            let at = started.elapsed();
            figures.faults.push(format!(
                "{} at {acks} acks ({:.1} s)",
                command.rsplit('/').next().unwrap_or(&command),
                at.as_secs_f64()
            ));
            faults_done += 1;
            fault = Some(tokio::spawn(async move {
                let status = Command::new("sh").arg("-c").arg(&command).status().await;
                match status {
                    Ok(s) if s.success() => Ok(()),
                    other => Err(format!("`{command}` failed: {other:?}")),
                }
            }));
        }
        if fault.as_ref().is_some_and(|r| r.is_finished()) {
            fault.take().unwrap().await.map_err(|e| e.to_string())??;
        }

        let idle = queue.is_empty()
            && delayed.is_empty()
            && fault.is_none()
            && consumers.iter().all(|c| c.in_flight.is_empty());
        if idle {
            if resubmitted {
                break;
            }
            // Days later: an operator resubmits the dead-letter queue, and the planned copies.
            resubmitted = true;
            for mut p in later.drain(..).chain(dead_letter_queue.drain(..)) {
                p.why = Why::Resubmitted;
                failures.remove(&(p.msg, p.target));
                queue.push_back(p);
            }
            continue;
        }

        if config.progress && last_progress.elapsed() >= Duration::from_secs(1) {
            last_progress = Instant::now();
            eprintln!(
                "  {:>6.1} s  {acks} acks, {} retryable nacks, {} in flight",
                started.elapsed().as_secs_f64(),
                figures.nacks_retryable,
                consumers.iter().map(|c| c.in_flight.len()).sum::<usize>()
            );
        }
        let event = tokio::select! {
            event = events.recv() => event,
            () = tokio::time::sleep(Duration::from_millis(10)) => None,
        };
        let Some((slot, generation, event)) = event else {
            continue;
        };
        if consumers[slot].generation != generation {
            continue;
        }
        match event {
            Event::Line(line) => match line.parse::<Reply>()? {
                Reply::Ack { tag, duplicate } => {
                    let Some(flight) = consumers[slot].in_flight.remove(&tag) else {
                        return Err(format!("ack of unknown delivery {tag}"));
                    };
                    acks += 1;
                    if duplicate {
                        figures.duplicates_reported += 1;
                    } else {
                        figures.processed += 1;
                    }
                    let p = flight.publication;
                    acked.insert((p.msg, p.target));
                }
                Reply::Nack { tag, retryable } => {
                    let Some(flight) = consumers[slot].in_flight.remove(&tag) else {
                        return Err(format!("nack of unknown delivery {tag}"));
                    };
                    let mut p = flight.publication;
                    p.why = Why::Redelivered;
                    p.paired = false;
                    if retryable {
                        figures.nacks_retryable += 1;
                        delayed.push((Instant::now() + Duration::from_millis(100), p));
                    } else {
                        figures.nacks_failed += 1;
                        if messages[p.msg].behaviour == Behaviour::Succeed {
                            figures.unexpected_failures += 1;
                        }
                        let failed = failures.entry((p.msg, p.target)).or_default();
                        *failed += 1;
                        if *failed >= MAX_HANDLER_FAILURES {
                            figures.dead_lettered += 1;
                            acks += 1;
                            dead_letters.insert((p.msg, p.target));
                            dead_letter_queue.push(p);
                        } else {
                            delayed.push((Instant::now() + Duration::from_millis(20), p));
                        }
                    }
                }
                Reply::Paused { point, .. } => {
                    let consumer = &mut consumers[slot];
                    if !consumer.killed {
                        consumer.killed = true;
                        *figures.kills.entry(point).or_default() += 1;
                        consumer.child.start_kill().map_err(|e| e.to_string())?;
                    }
                }
            },
            Event::Exited => {
                let old = &mut consumers[slot];
                if !old.killed {
                    figures.unexpected_exits += 1;
                }
                let _ = old.child.wait().await;
                for (_, flight) in old.in_flight.drain() {
                    let mut p = flight.publication;
                    p.why = Why::Redelivered;
                    p.paired = false;
                    queue.push_front(p);
                }
                figures.consumer_restarts += 1;
                consumers[slot] = spawn(config, slot, generation + 1, &events_tx)?;
            }
        }
    }

    // Closing their stdin tells the consumers that no more deliveries come.
    for mut consumer in consumers {
        drop(consumer.stdin);
        if tokio::time::timeout(Duration::from_secs(5), consumer.child.wait())
            .await
            .is_err()
        {
            figures.unexpected_exits += 1;
        }
        let _ = consumer.child.start_kill();
    }
    figures.elapsed = started.elapsed();
    let dead_letters = dead_letters
        .into_iter()
        .filter(|key| !acked.contains(key))
        .collect();
    Ok(Outcome {
        messages,
        acked,
        dead_letters,
        figures,
    })
}

/// Starts consumer process `slot` and a task that forwards its stdout lines and its exit.
fn spawn(
    config: &Config,
    slot: usize,
    generation: u64,
    events: &mpsc::UnboundedSender<(usize, u64, Event)>,
) -> Result<Consumer, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let (kind, urls) = &config.targets[slot % config.targets.len()];
    let mut child = Command::new(exe)
        .arg("consumer")
        .arg(kind)
        .arg(urls)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start a consumer: {e}"))?;
    let stdin = child.stdin.take().expect("piped");
    let stdout = child.stdout.take().expect("piped");
    let events = events.clone();
    tokio::spawn(async move {
        let mut lines = BufReader::new(stdout).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let _ = events.send((slot, generation, Event::Line(line)));
        }
        let _ = events.send((slot, generation, Event::Exited));
    });
    Ok(Consumer {
        child,
        stdin,
        in_flight: HashMap::new(),
        generation,
        killed: false,
    })
}
