//! Compile-fail tests (trybuild) for the rules the types enforce: every `tests/compile_fail/*.rs`
//! must fail to compile with the pinned `.stderr` beside it. Regenerate the pinned output with
//! `TRYBUILD=overwrite cargo test --test compile_fail`.

#[test]
fn compile_fail() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/compile_fail/*.rs");
}
