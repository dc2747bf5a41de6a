//! The lines the broker (driver) and the consumer processes exchange over the consumers' stdin and
//! stdout: a delivery down, an acknowledgement, a negative acknowledgement or a "paused at a crash
//! point" up.

use std::fmt;
use std::str::FromStr;

use uuid::Uuid;

/// Which consumer a delivery is for; each keeps its own inbox record and its own effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// Adds a ledger row and increments a counter.
    Ledger,
    /// Records one email sent.
    Mailer,
}

/// What the handler does with the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    Succeed,
    /// Fails on the message's first delivery to a consumer, succeeds later.
    FailOnce,
    /// Fails every time: must end in the dead-letter queue, never marked done.
    Poison,
}

/// Where a consumer stops and waits to be SIGKILLed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CrashPoint {
    BeforeClaim,
    /// First thing in the body: the key is claimed, nothing else is written.
    AfterClaim,
    /// Between the body's two statements.
    InBody,
    /// After the commit, before the acknowledgement.
    AfterCommit,
}

pub const CRASH_POINTS: [CrashPoint; 4] = [
    CrashPoint::BeforeClaim,
    CrashPoint::AfterClaim,
    CrashPoint::InBody,
    CrashPoint::AfterCommit,
];

/// One delivery, as the broker hands it to a consumer.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub tag: u64,
    pub target: Target,
    pub message_id: Uuid,
    pub behaviour: Behaviour,
    /// 1 for the first delivery of this message to this target.
    pub attempt: u32,
    pub crash_at: Option<CrashPoint>,
}

/// What a consumer reports back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Ack { tag: u64, duplicate: bool },
    Nack { tag: u64, retryable: bool },
    Paused { tag: u64, point: CrashPoint },
}

macro_rules! words {
    ($t:ty: $($variant:path => $word:literal),* $(,)?) => {
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(match self { $($variant => $word),* })
            }
        }
        impl FromStr for $t {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s { $($word => Ok($variant),)* other => Err(format!("unknown {}: {other}", stringify!($t))) }
            }
        }
    };
}
words!(Target: Target::Ledger => "ledger", Target::Mailer => "mailer");
words!(Behaviour: Behaviour::Succeed => "succeed", Behaviour::FailOnce => "fail-once", Behaviour::Poison => "poison");
words!(CrashPoint:
    CrashPoint::BeforeClaim => "before-claim",
    CrashPoint::AfterClaim => "after-claim",
    CrashPoint::InBody => "in-body",
    CrashPoint::AfterCommit => "after-commit",
);

impl fmt::Display for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let crash = self.crash_at.map_or("none".to_owned(), |p| p.to_string());
        write!(
            f,
            "D {} {} {} {} {} {crash}",
            self.tag, self.target, self.message_id, self.behaviour, self.attempt
        )
    }
}

impl FromStr for Delivery {
    type Err = String;
    fn from_str(line: &str) -> Result<Self, String> {
        let parts: Vec<&str> = line.split_whitespace().collect();
        let ["D", tag, target, id, behaviour, attempt, crash] = parts[..] else {
            return Err(format!("not a delivery: {line}"));
        };
        Ok(Delivery {
            tag: tag.parse().map_err(|e| format!("{e}"))?,
            target: target.parse()?,
            message_id: id.parse().map_err(|e| format!("{e}"))?,
            behaviour: behaviour.parse()?,
            attempt: attempt.parse().map_err(|e| format!("{e}"))?,
            crash_at: match crash {
                "none" => None,
                point => Some(point.parse()?),
            },
        })
    }
}

impl fmt::Display for Reply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reply::Ack { tag, duplicate } => write!(
                f,
                "A {tag} {}",
                if *duplicate { "duplicate" } else { "processed" }
            ),
            Reply::Nack { tag, retryable } => write!(
                f,
                "N {tag} {}",
                if *retryable { "retryable" } else { "failed" }
            ),
            Reply::Paused { tag, point } => write!(f, "P {tag} {point}"),
        }
    }
}

impl FromStr for Reply {
    type Err = String;
    fn from_str(line: &str) -> Result<Self, String> {
        let parts: Vec<&str> = line.split_whitespace().collect();
        let (kind, tag, word) = match parts[..] {
            [kind, tag, word, ..] => (kind, tag.parse::<u64>().map_err(|e| format!("{e}"))?, word),
            _ => return Err(format!("not a reply: {line}")),
        };
        match kind {
            "A" => Ok(Reply::Ack {
                tag,
                duplicate: word == "duplicate",
            }),
            "N" => Ok(Reply::Nack {
                tag,
                retryable: word == "retryable",
            }),
            "P" => Ok(Reply::Paused {
                tag,
                point: word.parse()?,
            }),
            _ => Err(format!("not a reply: {line}")),
        }
    }
}
