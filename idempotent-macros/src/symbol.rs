//! The attribute's argument names, each written once, as serde_derive's `internals/symbol.rs`
//! does: parsing compares paths against these, and the "unknown argument" help lists them.

use std::fmt::{self, Display};

use syn::{Ident, Path};

/// An argument name, compared with `path == KEY`.
#[derive(Copy, Clone)]
pub(crate) struct Symbol(&'static str);

/// Declares each argument's constant and [`ARGUMENTS`] from one list.
macro_rules! symbols {
    ($($name:ident = $text:literal,)*) => {
        $(pub(crate) const $name: Symbol = Symbol($text);)*

        /// Every argument, in the order the help lists them.
        pub(crate) const ARGUMENTS: &[Symbol] = &[$($name),*];
    };
}

symbols! {
    KEY = "key",
    CONSUMER = "consumer",
    FINGERPRINT = "fingerprint",
    STORE_RESPONSE = "store_response",
    SENT_AT = "sent_at",
    ALLOW_UNSTABLE_KEY = "allow_unstable_key",
    CRATE = "crate",
}

/// Whether `path` names one of the [`ARGUMENTS`].
pub(crate) fn is_argument(path: &Path) -> bool {
    ARGUMENTS.iter().any(|symbol| path == *symbol)
}

/// The arguments for a help line: "`key`, `consumer`, … and `crate`".
pub(crate) fn argument_list() -> String {
    let mut list = String::new();
    for (i, symbol) in ARGUMENTS.iter().enumerate() {
        if i > 0 {
            list.push_str(if i + 1 == ARGUMENTS.len() {
                " and "
            } else {
                ", "
            });
        }
        list.push_str(&format!("`{symbol}`"));
    }
    list
}

impl PartialEq<Symbol> for Ident {
    fn eq(&self, word: &Symbol) -> bool {
        self == word.0
    }
}

impl PartialEq<Symbol> for &Ident {
    fn eq(&self, word: &Symbol) -> bool {
        *self == word.0
    }
}

impl PartialEq<Symbol> for Path {
    fn eq(&self, word: &Symbol) -> bool {
        self.is_ident(word.0)
    }
}

impl PartialEq<Symbol> for &Path {
    fn eq(&self, word: &Symbol) -> bool {
        self.is_ident(word.0)
    }
}

impl Display for Symbol {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_help_lists_every_argument() {
        assert_eq!(
            argument_list(),
            "`key`, `consumer`, `fingerprint`, `store_response`, `sent_at`, `allow_unstable_key` and `crate`"
        );
    }

    #[test]
    fn paths_match_their_symbol_only() {
        let path: Path = syn::parse_quote!(consumer);
        assert!(path == CONSUMER);
        assert!(!(path == KEY));
        assert!(is_argument(&path));
        let crate_path: Path = syn::parse_quote!(crate);
        assert!(crate_path == CRATE);
        assert!(!is_argument(&syn::parse_quote!(ttl)));
    }
}
