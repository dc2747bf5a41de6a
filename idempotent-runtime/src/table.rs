//! The inbox table's name, and the schema it is in when it is not the connection's own, checked
//! before they reach any SQL.

use std::fmt;

use crate::error::InboxError;

/// A validated inbox table name: 1 to 48 characters from `a-z`, `0-9` and `_`, not starting with
/// a digit. It is the only value the inbox ever splices into SQL (quoted), so nothing from
/// configuration can change a statement; the limit leaves room for the derived names (the
/// `<name>_calls` table and the indexes) within PostgreSQL's 63-byte identifiers.
///
/// An inbox made for a tenant's schema ([`Inbox::with_schema`](crate::Inbox::with_schema)) names
/// its tables with that schema in every statement; its [`Display`](fmt::Display) is then
/// `schema.name`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TableName {
    name: String,
    schema: Option<String>,
}

impl TableName {
    /// The default, `idempotent_inbox`.
    pub const DEFAULT: &'static str = "idempotent_inbox";

    /// The longest name accepted.
    pub const MAX_LEN: usize = 48;

    /// Checks `name`.
    pub fn new(name: &str) -> Result<Self, InboxError> {
        match identifier_fault(name, Self::MAX_LEN, "it is longer than 48 characters") {
            Some(reason) => Err(InboxError::TableName {
                name: name.to_owned(),
                reason,
            }),
            None => Ok(Self {
                name: name.to_owned(),
                schema: None,
            }),
        }
    }

    /// The same table in `schema` (PostgreSQL; see [`Inbox::with_schema`](crate::Inbox::with_schema)):
    /// 1 to 63 characters from `a-z`, `0-9` and `_`, not starting with a digit.
    pub fn in_schema(self, schema: &str) -> Result<Self, InboxError> {
        match identifier_fault(schema, 63, "it is longer than 63 characters") {
            Some(reason) => Err(InboxError::SchemaName {
                name: schema.to_owned(),
                reason,
            }),
            None => Ok(Self {
                schema: Some(schema.to_owned()),
                ..self
            }),
        }
    }

    /// Returns the name as given, without its schema.
    pub fn as_str(&self) -> &str {
        &self.name
    }

    /// Returns the schema the tables are in, when the inbox was made for one; `None`: the schema
    /// its connections create tables in.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The name quoted as an SQL identifier with `quote`: `"` for PostgreSQL and SQLite, `` ` ``
    /// for MySQL; with its schema before it when it has one. The names' characters need no
    /// escaping.
    pub(crate) fn quoted(&self, quote: char) -> String {
        self.qualify(format!("{quote}{}{quote}", self.name), quote)
    }

    /// The name of a table that belongs to this one (`<name>_<suffix>`), quoted likewise.
    pub(crate) fn quoted_suffixed(&self, suffix: &str, quote: char) -> String {
        self.qualify(self.index(suffix, quote), quote)
    }

    /// The name of an index of these tables (`<name>_<suffix>`), quoted but never with a schema:
    /// an index is made in its table's schema, and its name in `CREATE INDEX` cannot have one.
    pub(crate) fn index(&self, suffix: &str, quote: char) -> String {
        format!("{quote}{}_{suffix}{quote}", self.name)
    }

    fn qualify(&self, quoted: String, quote: char) -> String {
        match &self.schema {
            Some(schema) => format!("{quote}{schema}{quote}.{quoted}"),
            None => quoted,
        }
    }
}

/// What is wrong with `name` as an identifier, if anything; `too_long` says its length limit.
fn identifier_fault(name: &str, max_len: usize, too_long: &'static str) -> Option<&'static str> {
    if name.is_empty() {
        Some("it is empty")
    } else if name.len() > max_len {
        Some(too_long)
    } else if name.starts_with(|c: char| c.is_ascii_digit()) {
        Some("it starts with a digit")
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        Some("only a-z, 0-9 and _ are allowed")
    } else {
        None
    }
}

impl Default for TableName {
    fn default() -> Self {
        Self {
            name: Self::DEFAULT.to_owned(),
            schema: None,
        }
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.schema {
            Some(schema) => write!(f, "{schema}.{}", self.name),
            None => f.write_str(&self.name),
        }
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
        for schema in ["", "a\".\"b", "Tenant", "1t", "t;", &"s".repeat(64)] {
            assert!(
                TableName::default().in_schema(schema).is_err(),
                "{schema:?} was accepted"
            );
        }
    }

    #[test]
    fn a_schema_qualifies_tables_but_not_indexes() {
        let table = TableName::new("inbox")
            .unwrap()
            .in_schema("tenant_a")
            .unwrap();
        assert_eq!(table.quoted('"'), "\"tenant_a\".\"inbox\"");
        assert_eq!(
            table.quoted_suffixed("calls", '"'),
            "\"tenant_a\".\"inbox_calls\""
        );
        assert_eq!(table.index("calls_updated", '"'), "\"inbox_calls_updated\"");
        assert_eq!(table.to_string(), "tenant_a.inbox");
        assert_eq!(table.as_str(), "inbox");
    }
}
