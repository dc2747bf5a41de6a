//! The `#[idempotent]` attribute. Depend on the `idempotent-inbox` crate, which re-exports it
//! together with the runtime it expands to; the attribute is documented there.
//!
//! The attribute works in three steps, each its own module: `parse` reads the attribute's
//! arguments and the function's signature, `validate` checks them and reports every mistake at
//! once, and `expand` generates the rewritten function (generation never fails).
#![warn(missing_docs, unreachable_pub)]

use proc_macro::TokenStream;

mod ctxt;
mod expand;
mod parse;
mod symbol;
mod unstable;
mod validate;

/// Makes an async message handler idempotent; see the `idempotent-inbox` crate for the guide.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}
