//! The keys the HTTP layers of an inbox are handling in this process, so that a twin request gets
//! `409` before it reaches the database: at once on every backend, and on SQLite, where beginning
//! a transaction waits for every other writer, the only way a twin does not wait. Shared by the
//! inbox's clones, so that a transactional and a leased route sharing a consumer see each other's
//! keys too. Twins handled by other processes are the database's business (see
//! [`try_claim`](crate::store::try_claim)).
//!
//! A twin that is to wait for the first (a layer's `wait_for_first`) waits here for the key's
//! entry to go, woken when it does, and only one request per key and process goes on to the
//! database.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;
use tokio::time::Instant;

/// A table's consumer's key.
type Entry = (Box<str>, Box<str>, Vec<u8>);

/// The keys in flight, shared by every clone of one inbox (and so by every layer made from it).
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    /// Each key in flight, with what wakes the twins waiting for it to go.
    keys: Mutex<HashMap<Entry, Arc<Notify>>>,
}

/// A key marked in flight until this is dropped.
#[derive(Debug)]
pub(crate) struct Entered {
    registry: Arc<InFlight>,
    entry: Entry,
}

impl InFlight {
    fn keys(&self) -> MutexGuard<'_, HashMap<Entry, Arc<Notify>>> {
        self.keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Marks `consumer`'s `key` in `table` in flight; `None` when it already is.
    pub(crate) fn enter(
        self: &Arc<Self>,
        table: &str,
        consumer: &str,
        key: &[u8],
    ) -> Option<Entered> {
        self.try_enter(Self::entry(table, consumer, key)).ok()
    }

    /// Marks `consumer`'s `key` in `table` in flight, waiting until `until` for the request that
    /// holds it to end; `None` if it still holds it then.
    pub(crate) async fn enter_waiting(
        self: &Arc<Self>,
        table: &str,
        consumer: &str,
        key: &[u8],
        until: Instant,
    ) -> Option<Entered> {
        let entry = Self::entry(table, consumer, key);
        loop {
            let released = match self.try_enter(entry.clone()) {
                Ok(entered) => return Some(entered),
                Err(released) => released,
            };
            tokio::time::timeout_at(until, released).await.ok()?;
            // Woken once its time is over, a twin gives up rather than queue behind the others
            // (each of which would look at the database in turn).
            if Instant::now() >= until {
                return None;
            }
        }
    }

    fn entry(table: &str, consumer: &str, key: &[u8]) -> Entry {
        (table.into(), consumer.into(), key.to_vec())
    }

    /// Enters `entry`, or returns what completes once whoever holds it has let it go. The waiter
    /// is registered before the lock is let go, so a release in between is not missed.
    fn try_enter(
        self: &Arc<Self>,
        entry: Entry,
    ) -> Result<Entered, std::pin::Pin<Box<tokio::sync::futures::OwnedNotified>>> {
        let mut keys = self.keys();
        if let Some(released) = keys.get(&entry) {
            let mut released = Box::pin(released.clone().notified_owned());
            released.as_mut().enable();
            return Err(released);
        }
        keys.insert(entry.clone(), Arc::default());
        Ok(Entered {
            registry: self.clone(),
            entry,
        })
    }
}

impl Drop for Entered {
    fn drop(&mut self) {
        let released = self.registry.keys().remove(&self.entry);
        if let Some(released) = released {
            released.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_key_is_in_flight_until_its_entry_is_dropped() {
        let registry = Arc::new(InFlight::default());
        let first = registry.enter("t", "http", b"k").unwrap();
        assert!(registry.enter("t", "http", b"k").is_none());
        let other = registry.enter("t", "http", b"other").unwrap();
        let other_consumer = registry.enter("t", "api", b"k").unwrap();
        let other_table = registry.enter("u", "http", b"k").unwrap();
        drop(first);
        assert!(registry.enter("t", "http", b"k").is_some());
        drop((other, other_consumer, other_table));
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_twin_enters_when_the_first_goes_and_one_twin_at_a_time() {
        let registry = Arc::new(InFlight::default());
        let first = registry.enter("t", "http", b"k").unwrap();
        let start = Instant::now();
        let until = start + Duration::from_secs(10);
        let twins: Vec<_> = (0..3)
            .map(|_| {
                let registry = registry.clone();
                tokio::spawn(async move {
                    let entered = registry.enter_waiting("t", "http", b"k", until).await;
                    let entered_at = Instant::now();
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    drop(entered);
                    entered_at
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(2)).await;
        drop(first);
        let mut entered = Vec::new();
        for twin in twins {
            entered.push(twin.await.unwrap() - start);
        }
        entered.sort();
        // The first went at 2 s; each twin then held the key for 1 s in turn.
        let seconds = |s| Duration::from_secs(s);
        assert_eq!(entered, [seconds(2), seconds(3), seconds(4)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_twin_that_waits_too_long_gives_up() {
        let registry = Arc::new(InFlight::default());
        let _first = registry.enter("t", "http", b"k").unwrap();
        let until = Instant::now() + Duration::from_secs(1);
        assert!(
            registry
                .enter_waiting("t", "http", b"k", until)
                .await
                .is_none()
        );
        assert_eq!(until, Instant::now());
        // Another key is not held up.
        assert!(
            registry
                .enter_waiting("t", "http", b"j", until)
                .await
                .is_some()
        );
    }
}
