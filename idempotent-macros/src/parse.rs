//! Reads the attribute's arguments and the handler's signature without judging them: what is
//! missing or wrong is left for [`validate`](crate::validate), except what cannot be read at all.

use proc_macro2::{Span, TokenStream};
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Expr, ExprLit, FnArg, Lit, LitStr, Member, Meta, Pat, Token, Type};

use crate::ctxt::Ctxt;
use crate::symbol::{
    self, ALLOW_UNSTABLE_KEY, CONSUMER, CRATE, FINGERPRINT, KEY, SENT_AT, STORE_RESPONSE, Symbol,
};

/// The attribute's arguments, each as written (or `None` when absent).
#[derive(Default)]
pub(crate) struct Args {
    pub(crate) key: Slot<Key>,
    pub(crate) consumer: Slot<LitStr>,
    pub(crate) allow_unstable_key: Slot<LitStr>,
    pub(crate) krate: Slot<syn::Path>,
    pub(crate) store_response: Slot<Span>,
    pub(crate) fingerprint: Slot<Fingerprint>,
    /// The field that says when the message was sent, as written (one path, checked later).
    pub(crate) sent_at: Slot<Key>,
}

/// What `fingerprint` covers.
pub(crate) enum Fingerprint {
    /// `fingerprint`: the whole message.
    Whole,
    /// `fingerprint = ("amount", "currency")`: these fields.
    Fields(Key),
}

/// One argument's value; setting it twice is an error at the second name.
pub(crate) struct Slot<T> {
    pub(crate) value: Option<T>,
}

impl<T> Default for Slot<T> {
    fn default() -> Self {
        Self { value: None }
    }
}

impl<T> Slot<T> {
    fn set(&mut self, cx: &mut Ctxt, name: &syn::Path, value: T) {
        if self.value.is_some() {
            cx.error_spanned(
                name,
                format_args!(
                    "duplicate argument `{}` in #[idempotent(...)]",
                    quote::quote!(#name)
                ),
            );
        } else {
            self.value = Some(value);
        }
    }
}

/// The message key: one field path, or several for a composite business key.
pub(crate) struct Key {
    pub(crate) paths: Vec<KeyPath>,
}

/// A path to a field of the message, such as `"meta.message_id"`.
pub(crate) struct KeyPath {
    /// The string literal as written, for spans and messages.
    pub(crate) lit: LitStr,
    /// The fields to follow, spanned on the literal.
    pub(crate) members: Vec<Member>,
}

/// Parses `key = "...", consumer = "...", ...`, recording every problem in `cx`.
pub(crate) fn args(cx: &mut Ctxt, tokens: TokenStream) -> Args {
    let mut args = Args::default();
    let metas = match Punctuated::<Meta, Token![,]>::parse_terminated.parse2(tokens) {
        Ok(metas) => metas,
        Err(error) => {
            cx.syn_error(error);
            return args;
        }
    };
    for meta in metas {
        if let Meta::Path(path) = &meta {
            if path == STORE_RESPONSE {
                args.store_response.set(cx, path, path.span());
                continue;
            }
            if path == FINGERPRINT {
                args.fingerprint.set(cx, path, Fingerprint::Whole);
                continue;
            }
        }
        let Meta::NameValue(nv) = meta else {
            let path = meta.path();
            if symbol::is_argument(path) {
                cx.error_spanned(
                    &meta,
                    format_args!(
                        "expected `{} = ...` in #[idempotent(...)]",
                        quote::quote!(#path)
                    ),
                );
            } else {
                unknown(cx, path);
            }
            continue;
        };
        let name = &nv.path;
        if name == KEY {
            if let Some(key) = key(cx, &nv.value, KEY) {
                args.key.set(cx, name, key);
            }
        } else if name == CONSUMER {
            if let Some(lit) = string(cx, &nv.value, CONSUMER) {
                args.consumer.set(cx, name, lit);
            }
        } else if name == FINGERPRINT {
            if let Some(fields) = key(cx, &nv.value, FINGERPRINT) {
                args.fingerprint.set(cx, name, Fingerprint::Fields(fields));
            }
        } else if name == SENT_AT {
            if let Some(field) = key(cx, &nv.value, SENT_AT) {
                args.sent_at.set(cx, name, field);
            }
        } else if name == STORE_RESPONSE {
            cx.error_spanned(
                &nv,
                "#[idempotent(store_response)] takes no value\nhelp: write `store_response` to store the body's `Ok` value for duplicates",
            );
        } else if name == ALLOW_UNSTABLE_KEY {
            if let Some(lit) = string(cx, &nv.value, ALLOW_UNSTABLE_KEY) {
                args.allow_unstable_key.set(cx, name, lit);
            }
        } else if name == CRATE {
            if let Some(lit) = string(cx, &nv.value, CRATE) {
                match lit.parse::<syn::Path>() {
                    Ok(path) => args.krate.set(cx, name, path),
                    Err(_) => cx.error_spanned(
                        &lit,
                        "#[idempotent(crate = \"...\")] must be a path, such as \"my_idempotent\"",
                    ),
                }
            }
        } else {
            unknown(cx, name);
        }
    }
    args
}

fn unknown(cx: &mut Ctxt, path: &syn::Path) {
    cx.error_spanned(
        path,
        format_args!(
            "unknown argument `{}` in #[idempotent(...)]\nhelp: the arguments are {}",
            quote::quote!(#path),
            symbol::argument_list(),
        ),
    );
}

fn string(cx: &mut Ctxt, value: &Expr, name: Symbol) -> Option<LitStr> {
    match value {
        Expr::Lit(ExprLit {
            lit: Lit::Str(lit), ..
        }) => Some(lit.clone()),
        _ => {
            cx.error_spanned(
                value,
                format_args!("#[idempotent({name} = \"...\")] takes a string literal"),
            );
            None
        }
    }
}

fn key(cx: &mut Ctxt, value: &Expr, name: Symbol) -> Option<Key> {
    let lits: Vec<&Expr> = match value {
        Expr::Tuple(tuple) if tuple.elems.is_empty() => {
            cx.error_spanned(
                tuple,
                format_args!("#[idempotent({name} = ())] names no field\nhelp: name at least one field of the message"),
            );
            return None;
        }
        Expr::Tuple(tuple) => tuple.elems.iter().collect(),
        Expr::Paren(paren) => vec![&*paren.expr],
        other => vec![other],
    };
    let mut paths = Vec::new();
    for lit in lits {
        let Expr::Lit(ExprLit {
            lit: Lit::Str(lit), ..
        }) = lit
        else {
            cx.error_spanned(
                lit,
                format_args!("#[idempotent({name} = ...)] takes a field name as a string, such as \"message_id\", or a tuple of them"),
            );
            continue;
        };
        if let Some(members) = key_path(cx, lit, name) {
            paths.push(KeyPath {
                lit: lit.clone(),
                members,
            });
        }
    }
    Some(Key { paths })
}

fn key_path(cx: &mut Ctxt, lit: &LitStr, name: Symbol) -> Option<Vec<Member>> {
    let text = lit.value();
    let mut members = Vec::new();
    for part in text.split('.') {
        let member = if !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
            part.parse::<u32>().ok().map(|index| {
                Member::Unnamed(syn::Index {
                    index,
                    span: lit.span(),
                })
            })
        } else {
            syn::parse_str::<syn::Ident>(part)
                .ok()
                .map(|ident| Member::Named(syn::Ident::new(&ident.to_string(), lit.span())))
        };
        match member {
            Some(member) => members.push(member),
            None => {
                cx.error_spanned(
                    lit,
                    format_args!(
                        "#[idempotent({name} = {:?})] is not a field path\nhelp: name a field of the message, such as \"message_id\" or \"meta.message_id\"",
                        text
                    ),
                );
                return None;
            }
        }
    }
    Some(members)
}

/// The handler's signature, classified.
pub(crate) struct Signature {
    /// The first parameter after `self`, if it is `&mut T`.
    pub(crate) connection: Result<Connection, Span>,
    /// The name the message is bound to, if the second parameter is a plain binding.
    pub(crate) message: Result<syn::Ident, Span>,
    /// The declared return type.
    pub(crate) output: Output,
    /// A parameter of type `IdempotencyKey`, which the rewritten function fills in: its position
    /// among the inputs, and its pattern.
    pub(crate) idempotency_key: Option<(usize, Box<Pat>, Box<Type>)>,
    /// The parameters whose type names an [`OUTBOX`] (`&mut Outbox` is filled in by the
    /// rewritten function; the others are mistakes), in order.
    pub(crate) outboxes: Vec<OutboxParam>,
    /// The positions among the inputs of the connection's and the message's parameters.
    pub(crate) slots: [Option<usize>; 2],
}

/// The type name of the outbox parameter.
pub(crate) const OUTBOX: &str = "Outbox";

/// A parameter whose type names the outbox: `pat: ty`, at `index` among the inputs.
pub(crate) struct OutboxParam {
    pub(crate) index: usize,
    pub(crate) pat: Box<Pat>,
    pub(crate) ty: Box<Type>,
    /// The type is `&mut Outbox` (not `Outbox` or `&Outbox`).
    pub(crate) by_mut_ref: bool,
}

/// The connection parameter, `pat: &mut ty`.
pub(crate) struct Connection {
    pub(crate) pat: Box<Pat>,
    /// The whole parameter type, `&mut ty`.
    pub(crate) reference: Type,
    /// The connection type behind the reference.
    pub(crate) ty: Type,
}

/// What the handler returns.
pub(crate) enum Output {
    /// Nothing (`()`).
    Missing(Span),
    /// `Result<T, E>` spelt out.
    Result { ok: Box<Type>, err: Box<Type> },
    /// Some other path, possibly an alias of `Result`; the compiler checks it.
    Path(Type),
    /// Any other type: not a `Result`.
    NotResult(Type),
}

/// Classifies the parameters and return type of `sig`.
pub(crate) fn signature(sig: &syn::Signature) -> Signature {
    let mut typed = sig.inputs.iter().filter_map(|arg| match arg {
        FnArg::Typed(pat_type) => Some(pat_type),
        FnArg::Receiver(_) => None,
    });
    let params_span = sig.paren_token.span.join();
    let connection = match typed.next() {
        None => Err(params_span),
        Some(param) => match strip_group(&param.ty) {
            Type::Reference(reference) if reference.mutability.is_some() => Ok(Connection {
                pat: param.pat.clone(),
                reference: (*param.ty).clone(),
                ty: (*reference.elem).clone(),
            }),
            _ => Err(param.span()),
        },
    };
    let message = match typed.next() {
        None => Err(params_span),
        Some(param) => match &*param.pat {
            Pat::Ident(pat) if pat.subpat.is_none() && pat.by_ref.is_none() => {
                Ok(pat.ident.clone())
            }
            other => Err(other.span()),
        },
    };
    let output = match &sig.output {
        syn::ReturnType::Default => Output::Missing(params_span),
        syn::ReturnType::Type(_, ty) => output(ty),
    };
    let outboxes = sig
        .inputs
        .iter()
        .enumerate()
        .filter_map(|(index, arg)| {
            let FnArg::Typed(param) = arg else {
                return None;
            };
            let (named, by_mut_ref) = match strip_group(&param.ty) {
                Type::Reference(reference) => (
                    names(&reference.elem, OUTBOX),
                    reference.mutability.is_some(),
                ),
                other => (names(other, OUTBOX), false),
            };
            named.then(|| OutboxParam {
                index,
                pat: param.pat.clone(),
                ty: param.ty.clone(),
                by_mut_ref,
            })
        })
        .collect();
    let mut typed_indexes = sig
        .inputs
        .iter()
        .enumerate()
        .filter(|(_, arg)| matches!(arg, FnArg::Typed(_)))
        .map(|(index, _)| index);
    let slots = [typed_indexes.next(), typed_indexes.next()];
    let idempotency_key = sig
        .inputs
        .iter()
        .enumerate()
        .find_map(|(index, arg)| match arg {
            FnArg::Typed(param) => match strip_group(&param.ty) {
                Type::Path(path)
                    if path
                        .path
                        .segments
                        .last()
                        .is_some_and(|last| last.ident == "IdempotencyKey") =>
                {
                    Some((index, param.pat.clone(), param.ty.clone()))
                }
                _ => None,
            },
            FnArg::Receiver(_) => None,
        });
    Signature {
        connection,
        message,
        output,
        idempotency_key,
        outboxes,
        slots,
    }
}

/// Whether `ty` is a path whose last segment is `name`.
fn names(ty: &Type, name: &str) -> bool {
    matches!(strip_group(ty), Type::Path(path)
        if path.path.segments.last().is_some_and(|last| last.ident == name))
}

fn output(ty: &Type) -> Output {
    let Type::Path(path) = strip_group(ty) else {
        return Output::NotResult(ty.clone());
    };
    let Some(last) = path.path.segments.last() else {
        return Output::NotResult(ty.clone());
    };
    if last.ident == "Result"
        && let syn::PathArguments::AngleBracketed(args) = &last.arguments
    {
        let types: Vec<&Type> = args
            .args
            .iter()
            .filter_map(|arg| match arg {
                syn::GenericArgument::Type(ty) => Some(ty),
                _ => None,
            })
            .collect();
        if let [ok, err] = types[..] {
            return Output::Result {
                ok: Box::new(ok.clone()),
                err: Box::new(err.clone()),
            };
        }
    }
    Output::Path(ty.clone())
}

/// Looks through the invisible groups `macro_rules!` puts around `$t:ty`.
fn strip_group(ty: &Type) -> &Type {
    match ty {
        Type::Group(group) => strip_group(&group.elem),
        Type::Paren(paren) => strip_group(&paren.elem),
        other => other,
    }
}
