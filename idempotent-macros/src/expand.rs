//! Generates the rewritten handler from a checked [`Plan`]. Nothing here can fail.

use proc_macro2::{Group, Span, TokenStream, TokenTree};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{FnArg, ItemFn};

use crate::ctxt::Ctxt;
use crate::validate::{Outline, Plan, Rejected};
use crate::{parse, validate};

/// The whole attribute: parse, validate, generate. On errors, the errors next to the function, so
/// that one mistake is one error: with the rewritten signature and a body that never runs when the
/// signature could be read (so that callers passing the inbox compile), else as the user wrote it.
pub(crate) fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let function: ItemFn = match syn::parse2(item.clone()) {
        Ok(function) => function,
        Err(error) => {
            let error = syn::Error::new(
                error.span(),
                "#[idempotent] goes on an `async fn` handler or method",
            )
            .to_compile_error();
            return quote!(#error #item);
        }
    };
    let mut cx = Ctxt::default();
    let args = parse::args(&mut cx, args);
    let signature = parse::signature(&function.sig);
    match validate::plan(cx, args, &function.sig, signature) {
        Ok(plan) => rewrite(&plan, function),
        Err(Rejected { errors, outline }) => {
            let errors = errors.to_compile_error();
            match outline {
                Some(outline) => {
                    let function = fallback(&outline, function);
                    quote!(#errors #function)
                }
                None => quote!(#errors #function),
            }
        }
    }
}

/// The function callers expect, with a body that never runs, as thiserror's `fallback.rs` does.
fn fallback(outline: &Outline, mut function: ItemFn) -> ItemFn {
    rewrite_signature(outline, &mut function);
    // The parameters are unused, and so would be the `IdempotencyKey` import of the removed one.
    function
        .attrs
        .push(syn::parse_quote!(#[allow(unused_variables)]));
    let key_ty = outline
        .idempotency_key
        .as_ref()
        .map(|(_, _, ty)| quote!(let _: #ty;));
    let outbox_ty = outline.outbox.as_ref().map(|param| {
        let ty = &param.ty;
        quote!(let _: #ty;)
    });
    function.block = syn::parse_quote!({
        #key_ty
        #outbox_ty
        ::core::unimplemented!()
    });
    function
}

/// The signature callers see: an `async fn` taking the inbox instead of the connection, without the
/// `IdempotencyKey` and `&mut Outbox` parameters (the claim provides them), returning the outcome
/// wrapped in `Handled` and `HandlerError`.
fn rewrite_signature(outline: &Outline, function: &mut ItemFn) {
    let Outline {
        krate,
        connection,
        ok,
        err,
        declared_output,
        idempotency_key,
        outbox,
    } = outline;
    let fn_span = function.sig.fn_token.span;
    function
        .sig
        .asyncness
        .get_or_insert_with(|| syn::Token![async](fn_span));
    let private = quote!(#krate::__private);
    let inbox = format_ident!("inbox", span = Span::mixed_site());
    let connection_ty = &connection.ty;
    let inbox_param: FnArg = syn::parse_quote_spanned! {connection.reference.span()=>
        #inbox: &#private::InboxFor<#connection_ty>
    };
    if let Some(param) = function
        .sig
        .inputs
        .iter_mut()
        .find(|arg| matches!(arg, FnArg::Typed(_)))
    {
        *param = inbox_param;
    }
    let filled_in: Vec<usize> = idempotency_key
        .iter()
        .map(|(index, _, _)| *index)
        .chain(outbox.iter().map(|param| param.index))
        .collect();
    function.sig.inputs = std::mem::take(&mut function.sig.inputs)
        .into_iter()
        .enumerate()
        .filter(|(i, _)| !filled_in.contains(i))
        .map(|(_, arg)| arg)
        .collect();
    function.sig.output = syn::parse_quote_spanned! {declared_output.span()=>
        -> ::core::result::Result<#private::Handled<#ok>, #private::HandlerError<#err>>
    };
}

/// Replaces the connection parameter by the inbox and wraps the body in claim and commit.
fn rewrite(plan: &Plan, mut function: ItemFn) -> TokenStream {
    let Plan {
        outline,
        consumer,
        key,
        message,
        store_response,
        fingerprint,
        sent_at,
    } = plan;
    let Outline {
        krate,
        connection,
        ok,
        err,
        declared_output,
        idempotency_key,
        outbox,
    } = outline;
    let private = quote!(#krate::__private);
    let site = Span::mixed_site();
    let inbox = format_ident!("inbox", span = site);
    let claimed = format_ident!("__claimed", span = site);
    let result = format_ident!("__result", span = site);
    let builder = format_ident!("__key", span = site);
    let fake_return = format_ident!("__fake_return", span = site);
    let checks_var = format_ident!("__checks", span = site);
    let connection_var = format_ident!("__connection", span = site);
    let outbox_var = format_ident!("__outbox", span = site);

    let connection_pat = &connection.pat;
    let connection_ref = &connection.reference;
    rewrite_signature(outline, &mut function);
    let hand_over_key = idempotency_key
        .as_ref()
        .map(|(_, pat, ty)| quote! { let #pat: #ty = #claimed.idempotency_key(); });

    // A field access carries its literal's span, so that a missing field or a key type that is not
    // a `StableKey` is reported on the name the user wrote.
    let field = |path: &crate::parse::KeyPath| {
        let span = path.lit.span();
        let message = syn::Ident::new(&message.to_string(), span);
        let members = &path.members;
        quote_spanned! {span=> &#message #(.#members)* }
    };
    let pushes = key.iter().map(|path| {
        let field = field(path);
        quote_spanned! {path.lit.span()=> #builder.push(#field); }
    });
    let fingerprint = match fingerprint {
        None => quote!(::core::option::Option::None),
        Some(fields) if fields.is_empty() => {
            quote!(::core::option::Option::Some(#private::fingerprint(&#message)))
        }
        Some(fields) => {
            let fields = fields.iter().map(|path| {
                let field = field(path);
                quote_spanned! {path.lit.span()=> #private::serializable(#field) }
            });
            quote!(::core::option::Option::Some(#private::fingerprint(&(#(#fields,)*))))
        }
    };
    // The send time's field, checked to be a `SentAt` on the name the user wrote.
    let sent_at = match sent_at {
        None => quote!(::core::option::Option::None),
        Some(path) => {
            let field = field(path);
            let check = respan(quote!(#private::sent_at), path.lit.span());
            quote_spanned! {path.lit.span()=> #check(#field) }
        }
    };
    // With `store_response`, the storing calls are spanned on the `Ok` type and name it as their
    // `T` (the second type parameter), so that rustc reports their bounds, which go through the
    // same trait as the `storable` check, where that check is: a type that cannot be stored is
    // one error, on the type the user wrote.
    let (start, finish, storing_span) = if *store_response {
        let on_ok = |function: TokenStream| {
            let path = respan(quote!(#private::#function), ok.span());
            quote_spanned!(ok.span()=> #path::<_, #ok, _>)
        };
        (
            on_ok(quote!(start_storing)),
            on_ok(quote!(finish_storing)),
            ok.span(),
        )
    } else {
        (
            quote!(#private::start),
            quote!(#private::finish),
            Span::call_site(),
        )
    };
    let handler_name = function.sig.ident.to_string();
    let start_call = quote_spanned! {storing_span=>
        #start(#inbox, #consumer, #builder, #checks_var).await
    };
    let finish_call = quote_spanned! {storing_span=>
        #finish(#claimed, #result, |__e: &#err| {
            #[allow(unused_imports)]
            use #private::{ProbeAsRef as _, ProbeError as _, ProbeNone as _};
            (&&&#private::Probe(__e)).as_error()
        }).await
    };
    // The consumer-name limit is the runtime's constant, checked at compile time on the literal.
    let too_long = format!(
        "#[idempotent(consumer = \"...\")] is {} bytes long, more than the inbox accepts (`MAX_CONSUMER_LEN` bytes)\nhelp: choose a shorter name; it is stored in every inbox row",
        consumer.value().len()
    );
    let consumer_fits = quote_spanned! {consumer.span()=>
        const _: () = ::core::assert!(#consumer.len() <= #private::MAX_CONSUMER_LEN, #too_long);
    };
    // With `store_response`, one check that the `Ok` type can be stored, on that type, before the
    // calls whose bounds go through the same trait.
    let storable = store_response.then(|| {
        quote_spanned! {ok.span()=> #private::storable::<#ok>(); }
    });
    // The connection, and with an outbox parameter the claim's outbox too, each checked against
    // the type the user wrote.
    let hand_over_connection = match outbox {
        None => quote! {
            let #connection_pat: #connection_ref = #claimed.connection();
        },
        Some(param) => {
            let (pat, ty) = (&param.pat, &param.ty);
            // Spanned on the type the user wrote, so that a type of another `Outbox` is an error
            // there.
            let hand_over = respan(quote!(#private::outbox), ty.span());
            let outbox = quote_spanned! {ty.span()=> #hand_over(#outbox_var) };
            quote! {
                let (#connection_var, #outbox_var) = #claimed.connection_and_outbox();
                let #connection_pat: #connection_ref = #connection_var;
                let #pat: #ty = #outbox;
            }
        }
    };
    let body = &function.block;
    let block = quote! {{
        #consumer_fits
        #storable
        let #builder = {
            let mut #builder = #private::KeyBuilder::new();
            #(#pushes)*
            #builder.finish()
        };
        let #checks_var = #private::Checks {
            fingerprint: #fingerprint,
            sent_at: #sent_at,
        };
        #private::Instrument::instrument(async move {
        let mut #claimed = match #start_call {
            #private::Start::Claimed(claimed) => claimed,
            #private::Start::Done(outcome) => return outcome,
        };
        #hand_over_key
        let #result = {
            #hand_over_connection
            async move {
                #[allow(
                    unknown_lints,
                    unreachable_code,
                    clippy::diverging_sub_expression,
                    clippy::empty_loop,
                    clippy::let_unit_value,
                    clippy::needless_return
                )]
                if false {
                    let #fake_return: #declared_output = loop {};
                    return #fake_return;
                }
                #body
            }
            .await
        };
        #finish_call
        }, #private::handler_span(#consumer, #handler_name)).await
    }};
    function.block = syn::parse2(block).expect("the generated body is a block");
    quote!(#function)
}

/// `tokens` with every span set to `span`: for the runtime's path, which names the same items from
/// the user's `Ok` type as from the attribute.
fn respan(tokens: TokenStream, span: Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|mut token| {
            if let TokenTree::Group(group) = &token {
                let mut group = Group::new(group.delimiter(), respan(group.stream(), span));
                group.set_span(span);
                token = TokenTree::Group(group);
            }
            token.set_span(span);
            token
        })
        .collect()
}
