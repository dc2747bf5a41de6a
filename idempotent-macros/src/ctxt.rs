//! Collects every error of one attribute so that all of them are reported together.

use std::fmt::Display;

use proc_macro2::Span;
use quote::ToTokens;

/// The errors found so far.
#[derive(Default)]
pub(crate) struct Ctxt {
    errors: Vec<syn::Error>,
}

impl Ctxt {
    /// Records an error at `span`.
    pub(crate) fn error(&mut self, span: Span, message: impl Display) {
        self.errors.push(syn::Error::new(span, message));
    }

    /// Records an error spanning `tokens`.
    pub(crate) fn error_spanned(&mut self, tokens: impl ToTokens, message: impl Display) {
        self.errors.push(syn::Error::new_spanned(tokens, message));
    }

    /// Records an error syn already built.
    pub(crate) fn syn_error(&mut self, error: syn::Error) {
        self.errors.push(error);
    }

    /// All the errors as one, or `Ok` if there were none.
    pub(crate) fn check(self) -> syn::Result<()> {
        let mut errors = self.errors.into_iter();
        let Some(mut combined) = errors.next() else {
            return Ok(());
        };
        for error in errors {
            combined.combine(error);
        }
        Err(combined)
    }
}
