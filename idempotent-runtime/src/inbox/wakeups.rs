//! Waking the relays once outgoing messages are committed (PostgreSQL's `NOTIFY`; nothing on the
//! databases without one), in a statement of its own after the commit, coalesced per inbox.
//!
//! A `NOTIFY` inside the handler's transaction is atomic with its commit, and costs every such
//! commit PostgreSQL's lock on the notification queue, which notifying commits take one at a time:
//! 8 workers committing outgoing messages went at 0.61 of the same handler without them. Sent
//! after the commit instead, by one task per inbox and channel, handlers' commits take no such
//! lock, and a burst of commits wakes the relays once or twice rather than once each: while a
//! `NOTIFY` is being sent, the commits meanwhile ask for one more, sent after it. A `NOTIFY` that
//! fails or never comes (a crash right after the commit, the pool exhausted) leaves the message to
//! the relays' polling, which they do in any case.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use sqlx::Pool;

use crate::store::{Backend, OutboxStatements};

/// The least time between two `NOTIFY`s of a channel sent for a stream of commits.
const GAP: std::time::Duration = std::time::Duration::from_millis(3);

/// Nothing sent or to send.
const IDLE: u8 = 0;
/// A `NOTIFY` is being sent.
const SENDING: u8 = 1;
/// A `NOTIFY` is being sent, and another is to follow it.
const AGAIN: u8 = 2;

/// The state of each channel's `NOTIFY`, shared by an inbox's clones.
#[derive(Debug, Default)]
pub(crate) struct Wakeups {
    channels: Mutex<HashMap<Arc<str>, Arc<AtomicU8>>>,
}

impl Wakeups {
    /// Wakes the relays listening to `statements`' channel, on a connection of `pool`, in a task of
    /// its own: at once, or after the `NOTIFY` being sent, if one is.
    pub(crate) fn wake<DB: Backend>(&self, pool: &Pool<DB>, statements: &OutboxStatements) {
        let Some(notify) = statements.wake_up() else {
            return;
        };
        let state = {
            let mut channels = self
                .channels
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            channels.entry(notify.clone()).or_default().clone()
        };
        if !ask(&state) {
            return;
        }
        let (pool, statements) = (pool.clone(), statements.clone());
        // Made before the task: a task dropped before it first runs (its runtime shutting down)
        // drops it too, and the channel is idle again.
        let mut sending = Sending { state, done: false };
        tokio::spawn(async move {
            loop {
                match pool.acquire().await {
                    Ok(mut conn) => {
                        if let Err(error) = DB::outbox_notify(&mut conn, &statements).await {
                            tracing::debug!(%error, "the relays could not be woken; they poll");
                        }
                    }
                    Err(error) => {
                        tracing::debug!(%error, "the relays could not be woken; they poll")
                    }
                }
                if !sent(&sending.state) {
                    sending.finish();
                    return;
                }
                // Commits keep coming: the relays are awake, or woken by the one just sent.
                tokio::time::sleep(GAP).await;
            }
        });
    }
}

/// A task sending a channel's `NOTIFY`s. One that ends before it is done (its runtime shut down,
/// before or while it ran) leaves the channel idle, so that a later commit sends again.
struct Sending {
    state: Arc<AtomicU8>,
    done: bool,
}

impl Sending {
    /// Nothing more to send: the channel is idle already.
    fn finish(&mut self) {
        self.done = true;
    }
}

impl Drop for Sending {
    fn drop(&mut self) {
        if !self.done {
            self.state.store(IDLE, Ordering::Release);
        }
    }
}

/// A commit asks for a `NOTIFY`: whether it is to send it (none was being sent); otherwise the
/// one being sent is followed by another.
fn ask(state: &AtomicU8) -> bool {
    loop {
        match state.compare_exchange(IDLE, SENDING, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return true,
            Err(SENDING) => {
                let again =
                    state.compare_exchange(SENDING, AGAIN, Ordering::AcqRel, Ordering::Acquire);
                // Sent and done meanwhile (`IDLE`): ask again.
                if !matches!(again, Err(IDLE)) {
                    return false;
                }
            }
            Err(_) => return false,
        }
    }
}

/// One `NOTIFY` was sent: whether to send another (commits asked meanwhile); otherwise nothing is
/// being sent any more.
fn sent(state: &AtomicU8) -> bool {
    match state.compare_exchange(SENDING, IDLE, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => false,
        Err(_) => {
            state.store(SENDING, Ordering::Release);
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commits_while_one_is_sent_get_one_more_after_it_and_no_more() {
        let state = AtomicU8::new(IDLE);
        assert!(ask(&state), "nothing is being sent: this commit sends");
        assert!(!ask(&state), "one is being sent: one more after it");
        assert!(!ask(&state), "one more is asked for already");
        assert!(sent(&state), "the one asked for meanwhile");
        assert!(!sent(&state), "nothing asked for meanwhile: done");
        assert_eq!(state.load(Ordering::Acquire), IDLE);
        assert!(ask(&state), "a later commit sends again");
    }
}
