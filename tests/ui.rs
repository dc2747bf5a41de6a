//! Misuse of `#[idempotent]` is a compile error with a clear message: one case per mistake under
//! `tests/ui/`, each with the `.stderr` the compiler must print; and the forms that must compile
//! under `tests/ui/pass/`. Regenerate with `TRYBUILD=overwrite cargo test --all-features --test ui`
//! and read every diff. The compiler lists the connection types the enabled features implement, so
//! the snapshots are those of the README's test command, which enables every feature.
#![cfg(all(feature = "postgres", feature = "sqlite", feature = "mysql"))]

#[test]
fn misuse_is_a_compile_error() {
    trybuild::TestCases::new().compile_fail("tests/ui/*.rs");
}

#[test]
fn supported_forms_compile() {
    trybuild::TestCases::new().pass("tests/ui/pass/*.rs");
}
