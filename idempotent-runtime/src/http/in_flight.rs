//! The keys a layer is handling in this process, so that a twin request gets `409` before it
//! reaches the database: at once on every backend, and on SQLite, where beginning a transaction
//! waits for every other writer, the only way a twin does not wait. Twins handled by other
//! processes are the database's business (see [`no_wait`](crate::store::no_wait)).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

/// The keys in flight, shared by every clone of one layer.
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    keys: Mutex<HashSet<Vec<u8>>>,
}

/// A key marked in flight until this is dropped.
#[derive(Debug)]
pub(crate) struct Entered {
    registry: Arc<InFlight>,
    key: Vec<u8>,
}

impl InFlight {
    /// Marks `key` in flight; `None` when it already is.
    pub(crate) fn enter(self: &Arc<Self>, key: &[u8]) -> Option<Entered> {
        let inserted = self
            .keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(key.to_vec());
        inserted.then(|| Entered {
            registry: self.clone(),
            key: key.to_vec(),
        })
    }
}

impl Drop for Entered {
    fn drop(&mut self) {
        self.registry
            .keys
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_in_flight_until_its_entry_is_dropped() {
        let registry = Arc::new(InFlight::default());
        let first = registry.enter(b"k").unwrap();
        assert!(registry.enter(b"k").is_none());
        let other = registry.enter(b"other").unwrap();
        drop(first);
        assert!(registry.enter(b"k").is_some());
        drop(other);
    }
}
