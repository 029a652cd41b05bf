//! Compile-fail tests (trybuild) for the rules the types enforce. Each case in
//! `tests/compile_fail/` has its expected compiler output pinned in a `.stderr` file beside it;
//! regenerate with `TRYBUILD=overwrite cargo test --test compile_fail` and review the diff.

#[test]
fn compile_fail() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/compile_fail/*.rs");
}
