//! The keys the HTTP layers of an inbox are handling in this process, so that a twin request gets
//! `409` before it reaches the database: at once on every backend, and on SQLite, where beginning
//! a transaction waits for every other writer, the only way a twin does not wait. Shared by the
//! inbox's clones, so that a transactional and a leased route sharing a consumer see each other's
//! keys too. Twins handled by other processes are the database's business (see
//! [`try_claim`](crate::store::try_claim)).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

/// A table's consumer's key.
type Entry = (Box<str>, Box<str>, Vec<u8>);

/// The keys in flight, shared by every clone of one inbox (and so by every layer made from it).
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    keys: Mutex<HashSet<Entry>>,
}

/// A key marked in flight until this is dropped.
#[derive(Debug)]
pub(crate) struct Entered {
    registry: Arc<InFlight>,
    entry: Entry,
}

impl InFlight {
    /// Marks `consumer`'s `key` in `table` in flight; `None` when it already is.
    pub(crate) fn enter(
        self: &Arc<Self>,
        table: &str,
        consumer: &str,
        key: &[u8],
    ) -> Option<Entered> {
        let entry: Entry = (table.into(), consumer.into(), key.to_vec());
        let inserted = self
            .keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(entry.clone());
        inserted.then(|| Entered {
            registry: self.clone(),
            entry,
        })
    }
}

impl Drop for Entered {
    fn drop(&mut self) {
        self.registry
            .keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(&self.entry);
    }
}

#[cfg(test)]
mod tests {
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
}
