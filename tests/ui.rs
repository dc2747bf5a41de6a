//! Misuse of `#[idempotent]` is a compile error with a clear message: one case per mistake under
//! `tests/ui/`, each with the `.stderr` the compiler must print; and the forms that must compile
//! under `tests/ui/pass/`. Regenerate with `TRYBUILD=overwrite` and read every diff.

#[test]
fn misuse_is_a_compile_error() {
    trybuild::TestCases::new().compile_fail("tests/ui/*.rs");
}

#[test]
fn supported_forms_compile() {
    trybuild::TestCases::new().pass("tests/ui/pass/*.rs");
}
