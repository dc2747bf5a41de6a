//! What a call of an idempotent handler did.

use crate::key::MessageKey;

/// What a call of an idempotent handler did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "acknowledge the message on either outcome"]
pub enum Handled<T> {
    /// This call ran the body and committed its effect; here is what the body returned.
    Processed(T),
    /// The key was already processed by this consumer: the body did not run and nothing changed.
    /// Acknowledge the message.
    Duplicate {
        /// The consumer that had processed it.
        consumer: String,
        /// The message's key, as stored.
        key: MessageKey,
        /// What the first call returned, for handlers with `store_response`; `None` otherwise, and
        /// for rows stored without a response.
        response: Option<T>,
    },
}

impl<T> Handled<T> {
    /// Returns whether this call ran the body.
    pub fn is_processed(&self) -> bool {
        matches!(self, Handled::Processed(_))
    }

    /// Returns whether the message had been processed before.
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Handled::Duplicate { .. })
    }

    /// Returns the body's value, if this call ran it.
    pub fn processed(self) -> Option<T> {
        match self {
            Handled::Processed(value) => Some(value),
            Handled::Duplicate { .. } => None,
        }
    }

    /// Returns the body's value: this call's, or the first call's stored response.
    pub fn value(self) -> Option<T> {
        match self {
            Handled::Processed(value) => Some(value),
            Handled::Duplicate { response, .. } => response,
        }
    }
}
