#!/usr/bin/env python3
"""Self-tests of check-layers.py and check-source.py: each rule fails where it should.

    python3 scripts/test_checks.py    # CI runs it before the checks themselves
"""
import importlib.util
import os
import shutil
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name):
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), os.path.join(HERE, name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


layers = load("check-layers")
source = load("check-source")


class TempTree(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.src = os.path.join(self.dir, "src")

    def tearDown(self):
        shutil.rmtree(self.dir)

    def write(self, files):
        shutil.rmtree(self.src, ignore_errors=True)
        for rel, text in files.items():
            p = os.path.join(self.src, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w", encoding="utf-8") as f:
                f.write(textwrap.dedent(text))


class Layers(TempTree):
    # A crate of three layers: error < memory < transfer; transfer has a folder of its own.
    FILES = {
        "lib.rs": "mod error;\nmod memory;\nmod transfer;\npub use error::Error;\n",
        "error.rs": "pub struct Error;\n",
        "memory.rs": "use crate::error::Error;\n",
        "transfer/mod.rs": "mod plan;\nmod wire;\nmod rails;\npub use wire::Frame;\n",
        "transfer/plan.rs": "use crate::memory;\n",
        "transfer/wire.rs": "use super::plan::Plan;\npub struct Frame;\n",
        "transfer/rails/mod.rs": "mod post;\n",
        "transfer/rails/post.rs": "use super::super::wire::Frame;\n",
    }
    TABLE = """\
        # comment
        .: error memory transfer
        transfer: plan wire rails
        transfer/rails: post
        """

    def run_check(self, files=None, table=None, drop=()):
        tree = dict(self.FILES)
        tree.update(files or {})
        for k in drop:
            del tree[k]
        self.write(tree)
        path = os.path.join(self.dir, "layers.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(textwrap.dedent(table if table is not None else self.TABLE))
        return layers.check(self.src, path)

    def test_a_tree_in_order_passes_and_prints_the_orders(self):
        bad, report = self.run_check()
        self.assertEqual(bad, [])
        self.assertIn("  .: error < memory < transfer", report)
        self.assertIn("  transfer: plan < wire < rails", report)
        self.assertIn("  transfer/rails: post", report)

    def test_a_file_importing_one_above_it_fails(self):
        bad, _ = self.run_check({"transfer/plan.rs": "use crate::memory;\nuse super::wire::Frame;\n"})
        self.assertEqual(len(bad), 2, bad)  # the order, and the cycle plan <-> wire
        self.assertIn("transfer/plan -> transfer/wire (`super::wire::Frame`): on the `transfer:` line plan"
                      " may only import entries before it (none), and wire is not", bad)
        self.assertIn("import cycle: transfer/plan <-> transfer/wire", bad)

    def test_a_top_level_module_importing_one_above_it_fails(self):
        bad, _ = self.run_check({"error.rs": "pub struct Error(crate::memory::Kind);\n"})
        self.assertEqual(len(bad), 1, bad)
        self.assertIn("error -> memory (`crate::memory::Kind`): on the `.:` line error", bad[0])

    def test_a_sub_folder_is_one_unit(self):
        # rails/post.rs imports plan: fine (rails is above plan); plan importing rails/post is not.
        bad, _ = self.run_check({"transfer/rails/post.rs": "use super::super::plan::Plan;\n"})
        self.assertEqual(bad, [])
        bad, _ = self.run_check({"transfer/plan.rs": "use super::rails::post::Post;\n"})
        self.assertTrue(any(b.startswith("transfer/plan -> transfer/rails/post") for b in bad), bad)

    def test_a_name_reexported_by_the_parent_counts_as_its_file(self):
        # `super::Frame` names the front door, which takes it from wire.rs: plan -> wire.
        bad, _ = self.run_check({"transfer/plan.rs": "fn f(_: super::Frame) {}\n"})
        self.assertEqual(len(bad), 2, bad)  # the order, and the cycle with wire's import of plan
        self.assertTrue(bad[1].startswith("transfer/plan -> transfer/wire (`super::Frame`): "), bad)

    def test_use_trees_are_expanded(self):
        self.assertEqual(layers.expand_use("a::{b,c::{d as e,self},*}"),
                         [(("a", "b"), "b"), (("a", "c", "d"), "e"), (("a", "c"), "c"), (("a", "*"), None)])
        bad, _ = self.run_check({"transfer/plan.rs": "use super::{wire::{self, Frame}};\n"})
        self.assertTrue(any(b.startswith("transfer/plan -> transfer/wire") for b in bad), bad)

    def test_a_missing_folder_line_says_what_to_add(self):
        bad, _ = self.run_check(table=".: error memory transfer\ntransfer: plan wire rails\n")
        self.assertEqual(bad, ["transfer/rails: folder not in layers.txt; add the line"
                               " `transfer/rails: post` (entries bottom up)"])

    def test_a_missing_entry_says_where_to_add_it(self):
        bad, _ = self.run_check({"transfer/stream.rs": "use super::wire::Frame;\n"})
        self.assertEqual(bad, ["transfer: stream.rs is not on the `transfer:` line of layers.txt;"
                               " add `stream` after wire"])
        table = self.TABLE.replace("transfer: plan wire rails", "transfer: plan rails")
        bad, _ = self.run_check(table=table)
        self.assertEqual(bad, ["transfer: wire.rs is not on the `transfer:` line of layers.txt;"
                               " add `wire` after plan and before rails"])

    def test_a_listed_entry_without_a_file_fails(self):
        bad, _ = self.run_check(table=self.TABLE.replace("plan wire rails", "plan wire local rails"))
        self.assertEqual(len(bad), 1, bad)
        self.assertIn("`local` is listed on the `transfer:` line of layers.txt, but there is no", bad[0])
        bad, _ = self.run_check(table=self.TABLE + "storage: io\n")
        self.assertEqual(bad, ["storage: layers.txt has a line for it, but no folder storage with .rs"
                               " files exists; remove it"])

    def test_a_bad_table_line_fails(self):
        for table in ("transfer plan\n", "forbid: a\n", ".: error\n.: memory\n", ".: error error\n"):
            with self.assertRaises(layers.TableError, msg=table):
                self.run_check(table=table)

    LOCAL = {
        "transfer/mod.rs": "mod plan;\nmod wire;\nmod rails;\nmod local;\npub use wire::Frame;\n"
                           "pub use local::Listener;\n",
        "transfer/local/mod.rs": "mod side;\npub use side::Listener;\n",
        "transfer/local/side.rs": "use super::super::wire::Frame;\npub struct Listener;\n",
    }
    FORBID_TABLE = TABLE.replace("plan wire rails", "plan wire rails local") + """\
        transfer/local: side
        forbid: transfer/rails transfer/local
        """

    def test_the_transports_never_import_each_other(self):
        bad, report = self.run_check(self.LOCAL, self.FORBID_TABLE)
        self.assertEqual(bad, [])
        self.assertIn("  forbid transfer/rails <-> transfer/local: 2 and 2 modules, no import between them", report)
        # local above rails on the line: the order allows it, the forbid line does not.
        files = dict(self.LOCAL, **{"transfer/local/side.rs": "use crate::transfer::rails::post::Post;\n"})
        bad, _ = self.run_check(files, self.FORBID_TABLE)
        self.assertEqual(bad, ["transfer/local/side -> transfer/rails/post (`crate::transfer::rails::post::Post`):"
                               " forbidden by `forbid: transfer/rails transfer/local` in layers.txt"
                               " (neither side imports the other)"])
        # The other way round, through the front door's re-export: the order and the forbid line.
        files = dict(self.LOCAL, **{"transfer/rails/post.rs": "use crate::transfer::Listener;\n"})
        bad, _ = self.run_check(files, self.FORBID_TABLE)
        self.assertTrue(any("transfer/rails/post -> transfer/local/side" in b and "forbidden" in b for b in bad), bad)

    def test_a_forbid_line_with_a_side_missing_is_idle(self):
        bad, report = self.run_check(table=self.TABLE + "forbid: transfer/rails transfer/local\n")
        self.assertEqual(bad, [])
        self.assertIn("  forbid transfer/rails <-> transfer/local: idle (transfer/local: no such module yet)", report)

    def test_an_allow_line_excuses_one_import_and_must_be_needed(self):
        files = {"transfer/plan.rs": "use super::wire::Frame;\n", "transfer/wire.rs": "pub struct Frame;\n"}
        bad, _ = self.run_check(files)
        self.assertEqual(len(bad), 1, bad)
        bad, report = self.run_check(files, self.TABLE + "allow: transfer/plan transfer/wire\n")
        self.assertEqual(bad, [])
        self.assertTrue(any(r.startswith("  allow transfer/plan -> transfer/wire") for r in report), report)
        bad, _ = self.run_check(table=self.TABLE + "allow: transfer/plan transfer/wire\n")
        self.assertEqual(bad, ["`allow: transfer/plan transfer/wire` in layers.txt: transfer/plan does not"
                               " import transfer/wire; remove the line"])
        bad, _ = self.run_check(table=self.TABLE + "allow: transfer/wire transfer/plan\n")
        self.assertEqual(bad, ["`allow: transfer/wire transfer/plan` in layers.txt: the `transfer:` line"
                               " already allows it; remove the line"])

    def test_tests_modules_and_comments_are_left_out(self):
        bad, _ = self.run_check({"transfer/plan.rs": "use crate::memory;\n// super::wire::Frame\n"
                                 "#[cfg(test)]\nmod tests {\n    use super::super::wire::Frame;\n}\n"})
        self.assertEqual(bad, [])


class Source(TempTree):
    def starts(self, files):
        base = {"lib.rs": "", "driver/ctx.rs": "pub fn spawn_thread() { std::thread::Builder::new().spawn(f) }\n"}
        base.update(files)
        self.write(base)
        return source.thread_starts(self.src, min_files=0)[1]

    def test_spawn_calls(self):
        self.assertEqual(source.spawn_calls("a.spawn (x) spawn_thread(y) s.spawn_scoped(\n z)"), [2, 30])

    def test_the_helpers_pass(self):
        self.assertEqual(self.starts({}), [])

    def test_every_other_thread_start_fails(self):
        found = self.starts({
            "a.rs": "fn f() {\n    std::thread::spawn(|| ());\n}\n",
            "b.rs": "use std::thread::spawn as go;\nfn f() { let h = go; }\nfn g() { s.spawn_scoped\n    (scope, f); }\n",
            "c.rs": "fn f() { let b = std::thread::Builder::new(); }\n",
            "d.rs": "fn f() { scope.spawn   (|| 1); }\n",
        })
        self.assertEqual([f.split(os.sep)[-1] for f in found], [
            "a.rs:2: std::thread::spawn(|| ());",
            "b.rs:3: fn g() { s.spawn_scoped",
            "c.rs:1: thread::Builder",
            "d.rs:1: fn f() { scope.spawn   (|| 1); }",
        ])

    def test_the_tokio_tasks_are_the_only_exceptions(self):
        found = self.starts({"rdma/async_qp.rs": "fn f() {\n    rt.spawn(run(x));\n    rt.spawn(other());\n}\n"})
        self.assertEqual([f.split(os.sep)[-1] for f in found], ["async_qp.rs:3: rt.spawn(other());"])
        found = self.starts({"rdma/other.rs": "fn f() {\n    rt.spawn(run(x));\n}\n"})
        self.assertEqual(len(found), 1, found)
        found = self.starts({"membership/etcd.rs": "fn f() {\n    rt.spawn(task);\n    rt.spawn(run(x));\n}\n"})
        self.assertEqual([f.split(os.sep)[-1] for f in found], ["etcd.rs:3: rt.spawn(run(x));"])

    def test_comments_and_the_tests_module_are_left_out(self):
        found = self.starts({"a.rs": "// std::thread::spawn(f)\nfn f() {} // spawn(g)\n"
                             "#[cfg(test)]\nmod tests {\n    fn t() { std::thread::spawn(f); }\n}\n"})
        self.assertEqual(found, [])

    def test_a_path_of_the_build_machine_baked_in_fails(self):
        self.write({
            "gpudirect/src/a.rs": "#[cfg(test)]\nmod tests {\n    const D: &str = env!(\"CARGO_MANIFEST_DIR\");\n}\n",
            "tests/b.rs": "fn d() -> PathBuf {\n    Path::new(env!( \"CARGO_MANIFEST_DIR\" )).join(\"x\")\n}\n",
            "benches/c.rs": "const T: Option<&str> = option_env!(\"CARGO_TARGET_TMPDIR\");\n",
            "examples/d.rs": "// env!(\"CARGO_MANIFEST_DIR\") in a comment\nfn d() { std::env::var_os(\"CARGO_MANIFEST_DIR\"); }\n",
            "target/debug/build/e.rs": "const D: &str = env!(\"CARGO_MANIFEST_DIR\");\n",
        })
        n, found = source.build_paths(self.src)
        self.assertEqual(n, 4)
        self.assertEqual([os.path.relpath(f, self.src) for f in found], [
            "benches/c.rs:1: const T: Option<&str> = option_env!(\"CARGO_TARGET_TMPDIR\");",
            "gpudirect/src/a.rs:3: const D: &str = env!(\"CARGO_MANIFEST_DIR\");",
            "tests/b.rs:2: Path::new(env!( \"CARGO_MANIFEST_DIR\" )).join(\"x\")",
        ])

    def test_a_figure_in_a_comment_fails(self):
        self.write({
            "a.rs": "/// Reads at 51.4 GB/s on an H200.\nfn f() {}\n",
            "b.rs": "// 3.2 MiB/s here\nconst S: &str = \"GB/s\"; // a string, not a comment\n",
            "c.rs": "/// Throughput in 10\u2079 bytes per second.\nfn g() {}\n",
            "d.rs": "//! the H100 and the H200 alike\n",
        })
        n, found = source.figures(self.src)
        self.assertEqual(n, 4)
        self.assertEqual([f[len(self.src) + 1:] for f in found], [
            "a.rs:1: /// Reads at 51.4 GB/s on an H200.",
            "b.rs:1: // 3.2 MiB/s here",
            "d.rs:1: //! the H100 and the H200 alike",
        ])

    def test_too_few_files_is_an_error(self):
        self.write({"lib.rs": ""})
        with self.assertRaises(SystemExit):
            source.thread_starts(self.src)


if __name__ == "__main__":
    unittest.main()
