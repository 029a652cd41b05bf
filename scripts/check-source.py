#!/usr/bin/env python3
"""Rules on gpudirect's sources that no compiler checks (run by CI; scripts/test_checks.py tests it).

Threads: every thread the crate starts goes through `driver::ctx::spawn_thread` or
`spawn_scoped_thread` (they mark the thread as the library's). A call of anything named `spawn` or
`spawn_scoped` (a `std::thread::spawn`, a `Builder`'s, a scope's; however it was imported, across
lines) or a `thread::Builder` anywhere else in the crate's code fails. A file's code is what
precedes its `#[cfg(test)]` / `mod tests {` block (rustfmt keeps it last); comments are left out.
The spawns that are not threads (tokio tasks: on the caller's runtime, and on the etcd store's own
runtime, whose one thread is started through spawn_thread) are named below.

Build paths: no Rust code of the workspace (the crates, tests, benches, examples, their test
modules included) bakes in a path of the build machine with `env!("CARGO_MANIFEST_DIR")` (or
CARGO_MANIFEST_PATH, CARGO_TARGET_TMPDIR): the GPU bundle carries the binaries to a node where
that path does not exist. Cargo sets CARGO_MANIFEST_DIR at run time for what it runs
(`std::env::var_os`); a binary run elsewhere then finds it unset. Comments are left out.

Figures: no comment in gpudirect/src names a rate (GB/s, MB/s, GiB/s, MiB/s) or a machine (H200):
measured figures live in docs/, once, with the date, the machine and the command that made them,
where they do not go stale in several copies. A unit says what it is in words ("10⁹ bytes per
second").

    check-source.py [ROOT]    # ROOT: the repository (the threads rule reads ROOT/gpudirect/src)

Exit 1 naming each finding (file:line: code); otherwise one line per rule saying what was checked.
"""
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ROOT = os.path.join(HERE, "..")

# Where spawning is the point: the helpers themselves.
HELPER = ("driver", "ctx.rs")
# Tokio tasks, not threads: in each file, the lines starting this way. A task on the caller's
# runtime (async_qp.rs); a task on the etcd store's own runtime (etcd.rs).
TOKIO_TASKS = [
    (("rdma", "async_qp.rs"), "rt.spawn(run("),
    (("membership", "etcd.rs"), "rt.spawn(task"),
]

WHITESPACE = " \t\n\r\x0c"


def is_ident(c):
    return c.isascii() and (c.isalnum() or c == "_")


def spawn_calls(code):
    """Offsets of calls `spawn(` / `spawn_scoped(` (whitespace allowed before the parenthesis) in
    `code`, not parts of longer names."""
    found = []
    at = code.find("spawn")
    while at >= 0:
        if not (at > 0 and is_ident(code[at - 1])):
            i = at + len("spawn")
            if code.startswith("_scoped", i):
                i += len("_scoped")
            while i < len(code) and code[i] in WHITESPACE:
                i += 1
            if code[i: i + 1] == "(":
                found.append(at)
        at = code.find("spawn", at + 1)
    return found


def code_of(text):
    """A file's code: what precedes its tests module, comments out, lines kept (for the line
    numbers)."""
    code = text.split("#[cfg(test)]\nmod tests {")[0]
    return "\n".join(line.split("//")[0] for line in code.split("\n"))


def rust_files(src):
    """Every .rs file under src, build outputs (`target`) and hidden folders left out."""
    out = []
    for root, dirs, names in os.walk(src):
        dirs[:] = [d for d in dirs if d != "target" and not d.startswith(".")]
        out.extend(os.path.join(root, n) for n in names if n.endswith(".rs"))
    return sorted(out)


BUILD_PATH = re.compile(r'\b(?:option_)?env!\s*\(\s*"(CARGO_MANIFEST_DIR|CARGO_MANIFEST_PATH|CARGO_TARGET_TMPDIR)"')


def build_paths(root):
    """(number of files read, ["file:line: code"] for each path of the build machine baked in)."""
    files = rust_files(root)
    found = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            lines = [line.split("//")[0] for line in fh.read().split("\n")]
        for no, line in enumerate(lines, 1):
            if BUILD_PATH.search(line):
                found.append(f"{f}:{no}: {line.strip()}")
    return len(files), found


def thread_starts(src, min_files=50):
    """(number of files read, ["file:line: call"] for each thread started past the helpers)."""
    files = rust_files(src)
    if len(files) <= min_files:
        raise SystemExit(f"found only {len(files)} .rs files under {src}: is it gpudirect/src?")
    found = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            code = code_of(fh.read())
        parts = tuple(os.path.normpath(f).split(os.sep))
        helper = parts[-2:] == HELPER
        tasks = [start for where, start in TOKIO_TASKS if parts[-2:] == where]

        def line(at):
            return code.count("\n", 0, at) + 1

        for at in spawn_calls(code):
            start = code.rfind("\n", 0, at) + 1
            call = code[start:].split("\n", 1)[0].strip()
            if helper or any(call.startswith(t) for t in tasks):
                continue
            found.append(f"{f}:{line(at)}: {call}")
        at = code.find("thread::Builder")
        while at >= 0:
            if not helper:
                found.append(f"{f}:{line(at)}: thread::Builder")
            at = code.find("thread::Builder", at + 1)
    return len(files), found


FIGURE = re.compile(r"\b(?:GB|MB|GiB|MiB|KB|KiB)/s\b|\bH[0-9]{3}\b")


def figures(src):
    """(number of files read, ["file:line: comment"] for each comment naming a rate or a GPU model)."""
    files = rust_files(src)
    found = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            for no, line in enumerate(fh.read().split("\n"), 1):
                at = line.find("//")
                if at >= 0 and FIGURE.search(line[at:]):
                    found.append(f"{f}:{no}: {line.strip()}")
    return len(files), found


def main(argv):
    root = os.path.normpath(argv[0] if argv else DEFAULT_ROOT)
    n, threads = thread_starts(os.path.join(root, "gpudirect", "src"))
    m, paths = build_paths(root)
    k, figs = figures(os.path.join(root, "gpudirect", "src"))
    if threads:
        print("threads started past driver::ctx::spawn_thread / spawn_scoped_thread:")
        print("\n".join(threads))
    if paths:
        print("paths of the build machine baked into a binary (read std::env::var_os at run time):")
        print("\n".join(paths))
    if figs:
        print("measured figures in comments (they belong in docs/, once, dated, with the command):")
        print("\n".join(figs))
    if threads or paths or figs:
        return 1
    print(f"threads ok: {n} files of gpudirect/src start threads only through driver::ctx::spawn_thread"
          f" and spawn_scoped_thread (besides them, tokio tasks: "
          + ", ".join(f"`{t}` in {'/'.join(w)}" for w, t in TOKIO_TASKS) + ")")
    print(f"build paths ok: none of the workspace's {m} .rs files bakes in CARGO_MANIFEST_DIR or the like")
    print(f"figures ok: no comment in the {k} files of gpudirect/src names a rate or a GPU model")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
