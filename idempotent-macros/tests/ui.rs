//! Misuse of `#[idempotent]` is a compile error with a clear message: one case per mistake under
//! `tests/ui/<topic>/` (the folders of [`TOPICS`]), each with the `.stderr` the compiler must
//! print; and the forms that must compile under `tests/ui/pass/`. Regenerate with
//! `TRYBUILD=overwrite cargo test -p idempotent-macros --test ui` and read every diff. The cases
//! are built against the facade with the three databases' features (this crate's
//! dev-dependencies): the compiler lists the connection types the enabled features implement.

/// The folders of the cases that must not compile, by what the mistake is about: the attribute's
/// arguments, the request fingerprint, the key, the lifecycle, the outbox, `sent_at`, the
/// function's signature, `store_response`. A new folder goes in this list.
const TOPICS: [&str; 8] = [
    "arguments",
    "fingerprint",
    "keys",
    "lifecycle",
    "outbox",
    "sent-at",
    "signature",
    "store-response",
];

#[test]
fn misuse_is_a_compile_error() {
    let cases = trybuild::TestCases::new();
    for topic in TOPICS {
        cases.compile_fail(format!("tests/ui/{topic}/*.rs"));
    }
}

#[test]
fn supported_forms_compile() {
    trybuild::TestCases::new().pass("tests/ui/pass/*.rs");
}
