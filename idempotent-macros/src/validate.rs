//! Checks the parsed attribute and signature, and turns them into the [`Plan`] that code
//! generation follows. Every mistake is reported, each at its own span.

use proc_macro2::Span;
use syn::{LitStr, Member, Type};

use crate::ctxt::Ctxt;
use crate::parse::{Args, Connection, Fingerprint, KeyPath, OutboxParam, Output, Signature};
use crate::unstable;

/// Everything code generation needs, all of it checked.
pub(crate) struct Plan {
    /// The signature callers see.
    pub(crate) outline: Outline,
    pub(crate) consumer: LitStr,
    pub(crate) key: Vec<KeyPath>,
    pub(crate) message: syn::Ident,
    /// Store the body's `Ok` value for duplicates.
    pub(crate) store_response: bool,
    /// The fields to fingerprint (empty: the whole message), if any.
    pub(crate) fingerprint: Option<Vec<KeyPath>>,
    /// The field that says when the message was sent, if any.
    pub(crate) sent_at: Option<KeyPath>,
}

/// The rewritten signature: what callers of the handler see. It needs only the connection
/// parameter, the message parameter and the return type to be read, so it is known even when
/// other parts of the attribute are wrong.
pub(crate) struct Outline {
    pub(crate) krate: syn::Path,
    pub(crate) connection: Connection,
    /// `Ok` and `Err` types of the declared return type.
    pub(crate) ok: Type,
    pub(crate) err: Type,
    /// The declared return type, for the body's type.
    pub(crate) declared_output: Type,
    /// The parameter the idempotency key is handed in.
    pub(crate) idempotency_key: Option<(usize, Box<syn::Pat>, Box<Type>)>,
    /// The parameter the outbox is handed in (`&mut Outbox`).
    pub(crate) outbox: Option<OutboxParam>,
}

/// What validation gives back when it found mistakes.
pub(crate) struct Rejected {
    /// Every mistake, combined.
    pub(crate) errors: syn::Error,
    /// The rewritten signature, if the handler's signature could be read, so that its callers see
    /// the function they expect and the mistakes are the only errors.
    pub(crate) outline: Option<Box<Outline>>,
}

/// Checks everything and reports every problem at once.
pub(crate) fn plan(
    mut cx: Ctxt,
    args: Args,
    sig: &syn::Signature,
    parsed: Signature,
) -> Result<Plan, Rejected> {
    if sig.asyncness.is_none() {
        cx.error_spanned(
            sig.fn_token,
            "#[idempotent] handlers must be `async fn`s\nhelp: the claim, the body and the commit all talk to the database; write `async fn`",
        );
    }
    let krate: syn::Path = args
        .krate
        .value
        .unwrap_or_else(|| syn::parse_quote!(::idempotent));
    let consumer = consumer(&mut cx, args.consumer.value);
    let key = key(&mut cx, args.key.value, args.allow_unstable_key.value);
    let sent_at = args.sent_at.value.and_then(|field| sent_at(&mut cx, field));
    let fingerprint = match args.fingerprint.value {
        None => None,
        Some(Fingerprint::Whole) => Some(Vec::new()),
        Some(Fingerprint::Fields(fields)) => Some(fields.paths),
    };
    let (outbox, in_a_slot) = outbox(&mut cx, parsed.outboxes, parsed.slots);
    let connection = if in_a_slot[0] {
        Err(())
    } else {
        parsed.connection.map_err(|span| {
        cx.error(
            span,
            "#[idempotent] handlers take the transaction's connection as their first parameter\nhelp: write `tx: &mut sqlx::PgConnection` (or `&mut sqlx::SqliteConnection`, `&mut sqlx::MySqlConnection`) before the message",
        )
        })
    };
    let message = if in_a_slot[1] {
        Err(())
    } else {
        parsed.message.map_err(|span| {
        cx.error(
            span,
            "#[idempotent] handlers take the message, bound to a name, right after the connection\nhelp: write `msg: &MyMessage` as the second parameter; the key is read from its fields",
        )
        })
    };
    let output = match parsed.output {
        Output::Result { ok, err } => Some((*ok, *err)),
        Output::Path(ty) => {
            let ok = syn::parse_quote!(<#ty as #krate::__private::HandlerResult>::Ok);
            let err = syn::parse_quote!(<#ty as #krate::__private::HandlerResult>::Err);
            Some((ok, err))
        }
        Output::Missing(span) => {
            cx.error(span, not_result());
            None
        }
        Output::NotResult(ty) => {
            cx.error_spanned(ty, not_result());
            None
        }
    };
    let outline = match (connection, &message, output, &sig.output) {
        (Ok(connection), Ok(_), Some((ok, err)), syn::ReturnType::Type(_, declared)) => {
            Some(Outline {
                krate,
                connection,
                ok,
                err,
                declared_output: (**declared).clone(),
                idempotency_key: parsed.idempotency_key,
                outbox,
            })
        }
        _ => None,
    };
    if let Err(errors) = cx.check() {
        return Err(Rejected {
            errors,
            outline: outline.map(Box::new),
        });
    }
    let (Some(outline), Some(consumer), Some(key), Ok(message)) = (outline, consumer, key, message)
    else {
        unreachable!("every missing piece recorded an error");
    };
    Ok(Plan {
        outline,
        consumer,
        key,
        message,
        store_response: args.store_response.value.is_some(),
        fingerprint,
        sent_at,
    })
}

/// The outbox parameter: one, typed `&mut Outbox`, after the connection and the message. Also says
/// whether an outbox parameter sits where the connection or the message belongs (reported here,
/// so that those slots report nothing more).
fn outbox(
    cx: &mut Ctxt,
    params: Vec<OutboxParam>,
    slots: [Option<usize>; 2],
) -> (Option<OutboxParam>, [bool; 2]) {
    let mut found = None;
    let mut in_a_slot = [false; 2];
    for param in params {
        if let Some(slot) = slots.iter().position(|slot| *slot == Some(param.index)) {
            in_a_slot[slot] = true;
            let what = ["the transaction's connection", "the message"][slot];
            cx.error_spanned(
                &param.ty,
                format_args!(
                    "#[idempotent] handlers take {what} here, not the outbox\nhelp: write the connection first and the message second; `outbox: &mut Outbox` goes after them"
                ),
            );
        } else if !param.by_mut_ref {
            cx.error_spanned(
                &param.ty,
                "#[idempotent] hands the outbox over as `&mut Outbox`\nhelp: write `outbox: &mut Outbox`; the body queues messages with `outbox.send(…)`, and the rewritten function writes them with its commit",
            );
        } else if found.is_some() {
            cx.error_spanned(
                &param.ty,
                "#[idempotent] handlers take one `&mut Outbox`\nhelp: queue every outgoing message through the same outbox: their positions in it give them their ids",
            );
        } else {
            found = Some(param);
        }
    }
    (found, in_a_slot)
}

/// The `sent_at` field: exactly one.
fn sent_at(cx: &mut Ctxt, field: crate::parse::Key) -> Option<KeyPath> {
    let mut paths = field.paths.into_iter();
    let first = paths.next()?;
    if let Some(second) = paths.next() {
        cx.error_spanned(
            &second.lit,
            "#[idempotent(sent_at = ...)] names one field\nhelp: name the field that says when the message was sent, such as `sent_at = \"meta.sent_at\"`",
        );
        return None;
    }
    Some(first)
}

fn not_result() -> &'static str {
    "#[idempotent] handlers must return a `Result`\nhelp: return `Result<T, YourError>`; an `Err` rolls the transaction back so that a redelivery runs the handler again"
}

fn consumer(cx: &mut Ctxt, consumer: Option<LitStr>) -> Option<LitStr> {
    let Some(consumer) = consumer else {
        cx.error(
            Span::call_site(),
            "#[idempotent] needs `consumer = \"...\"`\nhelp: name the service or handler that consumes the message, such as `consumer = \"orders\"`; it keeps its own record of processed messages, and must not change when the function is renamed",
        );
        return None;
    };
    // The length limit is the runtime's `MAX_CONSUMER_LEN`, which the generated code asserts.
    let value = consumer.value();
    if value.trim().is_empty() {
        cx.error_spanned(
            &consumer,
            "#[idempotent(consumer = \"...\")] must not be empty",
        );
    }
    if value.contains('\0') {
        cx.error_spanned(
            &consumer,
            "#[idempotent(consumer = \"...\")] must not contain a NUL byte\nhelp: the name is stored as database text, which cannot hold `\\0` in PostgreSQL; remove it",
        );
    }
    Some(consumer)
}

fn key(
    cx: &mut Ctxt,
    key: Option<crate::parse::Key>,
    allow_unstable: Option<LitStr>,
) -> Option<Vec<KeyPath>> {
    let Some(key) = key else {
        cx.error(
            Span::call_site(),
            "#[idempotent] needs `key = \"...\"`\nhelp: name the message field that identifies it stably, such as `key = \"message_id\"`, or a business key such as `key = (\"order_id\", \"payment_id\")`",
        );
        return None;
    };
    let mut any_unstable = false;
    for path in &key.paths {
        let unstable = path.members.iter().find_map(|member| match member {
            Member::Named(ident) => unstable::check(&ident.to_string()),
            Member::Unnamed(_) => None,
        });
        let Some(unstable) = unstable else { continue };
        any_unstable = true;
        if allow_unstable.is_none() {
            cx.error_spanned(
                &path.lit,
                format_args!(
                    "#[idempotent(key = {:?})] names {}, which is not a stable message key\nhelp: {}\nhelp: if this field really is unique per message, say why with `allow_unstable_key = \"...\"`",
                    path.lit.value(),
                    unstable.what,
                    unstable.help
                ),
            );
        }
    }
    if let Some(reason) = allow_unstable {
        if reason.value().trim().is_empty() {
            cx.error_spanned(
                &reason,
                "#[idempotent(allow_unstable_key = \"...\")] needs a written reason\nhelp: say why this field is unique per message and the same on every delivery",
            );
        } else if !any_unstable {
            cx.error_spanned(
                &reason,
                "#[idempotent(allow_unstable_key = \"...\")] is not needed: no key field has an unstable name\nhelp: remove it",
            );
        }
    }
    Some(key.paths)
}
