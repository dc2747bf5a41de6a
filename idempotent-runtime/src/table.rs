//! The inbox table's name, checked before it reaches any SQL.

use std::fmt;

use crate::error::InboxError;

/// A validated inbox table name: 1 to 48 characters from `a-z`, `0-9` and `_`, not starting with
/// a digit. It is the only value the inbox ever splices into SQL (quoted), so nothing from
/// configuration can change a statement; the limit leaves room for the derived names (the
/// `<name>_calls` table and the indexes) within PostgreSQL's 63-byte identifiers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TableName(String);

impl TableName {
    /// The default, `idempotent_inbox`.
    pub const DEFAULT: &'static str = "idempotent_inbox";

    /// The longest name accepted.
    pub const MAX_LEN: usize = 48;

    /// Checks `name`.
    pub fn new(name: &str) -> Result<Self, InboxError> {
        let reason = if name.is_empty() {
            Some("it is empty")
        } else if name.len() > Self::MAX_LEN {
            Some("it is longer than 48 characters")
        } else if name.starts_with(|c: char| c.is_ascii_digit()) {
            Some("it starts with a digit")
        } else if !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            Some("only a-z, 0-9 and _ are allowed")
        } else {
            None
        };
        match reason {
            Some(reason) => Err(InboxError::TableName {
                name: name.to_owned(),
                reason,
            }),
            None => Ok(Self(name.to_owned())),
        }
    }

    /// Returns the name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name quoted as an SQL identifier with `quote`: `"` for PostgreSQL and SQLite, `` ` ``
    /// for MySQL. The name's characters need no escaping.
    pub(crate) fn quoted(&self, quote: char) -> String {
        format!("{quote}{}{quote}", self.0)
    }

    /// The name of a table or index that belongs to this one (`<name>_<suffix>`), quoted likewise.
    pub(crate) fn quoted_suffixed(&self, suffix: &str, quote: char) -> String {
        format!("{quote}{}_{suffix}{quote}", self.0)
    }
}

impl Default for TableName {
    fn default() -> Self {
        Self(Self::DEFAULT.to_owned())
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_names_are_refused() {
        for name in [
            "",
            "inbox; DROP TABLE x",
            "inbox\"",
            "in'box",
            "Inbox",
            "1inbox",
            "in box",
            "inbox\0",
            &"a".repeat(49),
        ] {
            assert!(TableName::new(name).is_err(), "{name:?} was accepted");
        }
        assert_eq!(
            TableName::new("orders_inbox_2").unwrap().quoted('"'),
            "\"orders_inbox_2\""
        );
    }
}
