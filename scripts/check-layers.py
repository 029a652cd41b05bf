#!/usr/bin/env python3
"""Check the module layering of gpudirect/src against the table scripts/layers.txt.

1. Order: the table has one line per folder (`.` is gpudirect/src itself) listing its entries
   bottom up: a file `x.rs` as `x`, a sub-folder `x/` as `x` too, taken as one unit (whatever a
   file inside it imports counts for `x`). An entry imports only entries listed before it on its
   folder's line. lib.rs and each mod.rs are their folder's front door, not entries. The table
   names every folder and every entry, and nothing that does not exist.
2. Cycles: inside each top-level module no two modules (files, or a folder's mod.rs) reference
   each other, directly or through a longer cycle.
3. Forbidden pairs: a line `forbid: a b` says no module under `a` (the module a, or any of its
   sub-modules) references one under `b`, nor the other way. The rule covers whatever modules
   exist under those names; a side with none yet is reported as idle.

A line `allow: a b` excuses one import that breaks the order (module a imports module b; both
exact module paths): a known exception, printed on every run until the code is reshaped. It never
excuses a cycle or a forbidden pair, and an `allow:` that excuses nothing is an error.

A parent's `mod x;` and `pub use x::...` re-exports are not references; anything else a file names
(`crate::a::b`, `super::x`, `self::x`, `x::` for a child) is. A name a module brings in with `use`
counts as what it names too: `super::Fence`, where the parent has `pub use fence::Fence`, also
references fence. Code after a file's `#[cfg(test)] mod tests {` is left out, and so are modules
declared only for tests (`#[cfg(test)] mod proptests;`): tests reach anywhere. They are still
entries of the table.

    check-layers.py [SRC] [--table FILE]   # SRC: gpudirect/src; FILE: layers.txt beside this script

Exit 1 with one line per violation; otherwise print the orders it checked.
"""
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SRC = os.path.join(HERE, "..", "gpudirect", "src")
DEFAULT_TABLE = os.path.join(HERE, "layers.txt")
TOP = "."  # the table's name for SRC itself


class TableError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# Reading the sources


def module_path(src, path):
    """gpudirect/src/rdma/qp.rs -> ('rdma', 'qp'); rdma/mod.rs -> ('rdma',); lib.rs -> ()."""
    rel = os.path.relpath(path, src)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib"):
        rel = rel[:-1]
    return tuple(rel)


def strip(text):
    text = re.sub(r"//[^\n]*", "", text)          # comments (also doc comments)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(\\.|[^"\\])*"', '""', text)  # string literals
    return text


def test_mod_cut(text):
    # cfg(test) modules: tests may reach anywhere in their own module
    m = re.search(r"#\[cfg\(test\)\]\s*mod\s+tests\s*\{", text)
    return text[: m.start()] if m else text


def read_tree(src):
    """{module path: its code} for every .rs file under src."""
    files = {}
    for root, _, names in os.walk(src):
        for n in names:
            if n.endswith(".rs"):
                p = os.path.join(root, n)
                with open(p, encoding="utf-8") as f:
                    files[module_path(src, p)] = test_mod_cut(strip(f.read()))
    return files


def split_top(s, sep):
    """Split `s` at `sep` characters outside braces."""
    out, depth, cur = [], 0, ""
    for c in s:
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        if c == sep and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += c
    out.append(cur)
    return out


def expand_use(tree, prefix=()):
    """A use tree -> [(path segments, the name it binds or None for a glob)].

    `a::{b, c::{d as e, self}, *}` -> (a,b) b; (a,c,d) e; (a,c) c; (a,*) None.
    """
    tree = tree.strip()
    if tree.startswith("::"):
        tree = tree[2:]
    brace = tree.find("{")
    if brace >= 0:
        head = [s for s in tree[:brace].split("::") if s]
        inner = tree[brace + 1: tree.rfind("}")]
        out = []
        for item in split_top(inner, ","):
            if item.strip():
                out.extend(expand_use(item, prefix + tuple(head)))
        return out
    path, _, alias = tree.partition(" as ")
    segs = [s.strip() for s in path.split("::") if s.strip()]
    if segs == ["self"]:
        return [(prefix, alias.strip() or (prefix[-1] if prefix else None))]
    segs = prefix + tuple(segs)
    if segs and segs[-1] == "*":
        return [(segs, None)]
    return [(segs, alias.strip() or (segs[-1] if segs else None))]


USE = re.compile(r"\b(pub(\([^)]*\))?\s+)?use\s+([^;]+);")


def uses_of(text):
    """(segments, bound name, is_pub, the path as text) of every path a file's `use` lines name."""
    out = []
    for m in USE.finditer(text):
        tree = re.sub(r"\s+", " ", m.group(3))
        tree = re.sub(r"\s*(::|[{},])\s*", r"\1", tree)
        for segs, name in expand_use(tree):
            out.append((list(segs), name, bool(m.group(1)), "::".join(segs)))
    return out


def inline_paths(text):
    """Paths a file's code names outside `use` lines: a::b:: paths, and `x::` for a child x."""
    body = USE.sub("", text)
    out = []
    for m in re.finditer(r"\b((?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)+)", body):
        out.append((m.group(1).split("::"), m.group(1)))
    for m in re.finditer(r"(?<![:\w])([a-z_][a-z0-9_]*)::[A-Za-z_]", body):
        out.append(([m.group(1)], m.group(1) + "::"))
    return out


class Tree:
    def __init__(self, src):
        self.files = read_tree(src)
        self.modules = set(self.files)
        self.uses = {m: uses_of(t) for m, t in self.files.items()}
        # The names each module's `use` lines bind (pub or not: descendants see both).
        self.bound = {m: {name: segs for segs, name, _, _ in us if name}
                      for m, us in self.uses.items()}
        self.test_only = self._test_only()
        self.edges, self.why = self._edges()

    def _test_only(self):
        """Modules their parent declares only for tests (`#[cfg(test)] mod x;`,
        `#[cfg(all(test, ...))] mod x;`), with their descendants: test code, which may reach
        anywhere, as a file's own `mod tests`."""
        pat = re.compile(r"#\[cfg\((?:test|all\(test\b[^\]]*\))\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;")
        roots = {m + (name,) for m, text in self.files.items() for name in pat.findall(text)}
        return {m for m in self.modules if any(m[: len(r)] == r for r in roots)}

    def resolve(self, mod, segs, depth=0):
        """The modules that path `segs`, seen from module `mod`, names: the longest known one, and
        where a `use` there binds the next name, the module that name comes from. [] for none."""
        if not segs:
            return []
        if segs[0] == "crate":
            base, rest = (), segs[1:]
        elif segs[0] == "super":
            base, rest = mod, segs
            while rest and rest[0] == "super":
                base, rest = base[:-1], rest[1:]
        elif segs[0] == "self":
            base, rest = mod, segs[1:]
        else:
            base, rest = mod, segs  # a child module, if one has that name
        best, used = None, 0
        cur = base
        for i, s in enumerate(rest):
            cur = cur + (s,)
            if cur in self.modules:
                best, used = cur, i + 1
            else:
                break
        if best is None and segs[0] in ("crate", "super", "self") and base in self.modules and base != mod:
            best = base
        if best is None:
            return []
        if used < len(rest) and depth < 8:
            via = self.bound.get(best, {}).get(rest[used])
            if via is not None and list(via) != list(segs):
                return [best] + self.resolve(best, list(via) + list(rest[used + 1:]), depth + 1)
        return [best]

    def _edges(self):
        edges = {m: set() for m in self.modules}
        why = {}
        for mod in self.modules:
            if mod in self.test_only:
                continue
            paths = [(segs, is_pub, text) for segs, _, is_pub, text in self.uses[mod]]
            paths += [(segs, False, text) for segs, text in inline_paths(self.files[mod])]
            for segs, is_pub, text in paths:
                if segs and segs[-1] == "*":
                    segs = segs[:-1]
                for tgt in self.resolve(mod, segs):
                    if tgt == mod or tgt in self.test_only:
                        continue
                    if is_pub and tgt[: len(mod)] == mod:
                        continue  # a parent re-exporting a descendant
                    edges[mod].add(tgt)
                    why.setdefault((mod, tgt), text)
        return edges, why

    def folders(self):
        """Every folder (as a module path) with its entries: {folder: {entry: 'file' | 'folder'}}."""
        out = {}
        for m in self.modules:
            if m:
                out.setdefault(m[:-1], {})
        for m in self.modules:
            if m:
                out[m[:-1]].setdefault(m[-1], "file")
        for m in self.modules:
            if m and m in out:
                out[m[:-1]][m[-1]] = "folder"
        return out


# ---------------------------------------------------------------------------------------------
# The table


def folder_name(folder):
    return "/".join(folder) if folder else TOP


def mod_name(mod):
    return "/".join(mod) if mod else "lib"


def read_table(path):
    """{folder: [entries bottom up]}, [(a, b) forbidden pairs], [(a, b) allowed imports]."""
    orders, forbid, allow, lines = {}, [], [], {}
    with open(path, encoding="utf-8") as f:
        for no, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            key, colon, rest = line.partition(":")
            key = key.strip()
            if not colon or not key:
                raise TableError(f"{path}:{no}: expected `folder: entries` or `forbid: a b`, got {line!r}")
            words = rest.split()
            if key in ("forbid", "allow"):
                if len(words) != 2:
                    raise TableError(f"{path}:{no}: `{key}:` takes two module paths, got {words}")
                (forbid if key == "forbid" else allow).append(tuple(tuple(w.strip("/").split("/")) for w in words))
                continue
            folder = () if key == TOP else tuple(key.strip("/").split("/"))
            if folder in orders:
                raise TableError(f"{path}:{no}: a second line for {key} (the first is line {lines[folder]})")
            dup = sorted({w for w in words if words.count(w) > 1})
            if dup:
                raise TableError(f"{path}:{no}: {key} lists {', '.join(dup)} twice")
            orders[folder] = words
            lines[folder] = no
    return orders, forbid, allow


def suggest(entries, deps):
    """A bottom-up order of `entries` that satisfies `deps` ({entry: entries it imports}), lowest
    first and alphabetical among equals; None when they form a cycle."""
    left, out = set(entries), []
    while left:
        ready = sorted(e for e in left if not (deps.get(e, set()) & left))
        if not ready:
            return None
        out.extend(ready)
        left -= set(ready)
    return out


# ---------------------------------------------------------------------------------------------
# The checks


def folder_deps(tree, allow=()):
    """{folder: {entry: {entries of the same folder it imports}}}, and one example import per
    entry pair: {(folder, a, b): (module, target)}. Imports in `allow` are left out."""
    deps, example = {}, {}
    for mod, tgts in sorted(tree.edges.items()):
        for t in sorted(tgts):
            if (mod, t) in allow:
                continue
            n = 0
            while n < len(mod) and n < len(t) and mod[n] == t[n]:
                n += 1
            if n == len(mod) or n == len(t):
                continue  # a module and its ancestor or descendant: not siblings
            folder, a, b = mod[:n], mod[n], t[n]
            deps.setdefault(folder, {}).setdefault(a, set()).add(b)
            example.setdefault((folder, a, b), (mod, t))
    return deps, example


def sccs(nodes, adj):
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in adj.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    for v in nodes:
        if v not in index:
            visit(v)
    return out


def check(src, table_path):
    """(violations, report lines): the checks above on the tree at `src`."""
    tree = Tree(src)
    orders, forbid, allow = read_table(table_path)
    folders = tree.folders()
    deps, example = folder_deps(tree, set(allow))
    tname = os.path.basename(table_path)
    bad, report = [], []

    def imp(mod, tgt):
        return f"{mod_name(mod)} -> {mod_name(tgt)} (`{tree.why[(mod, tgt)]}`)"

    # 1. the table is complete, then the order
    for folder in sorted(folders):
        entries = folders[folder]
        fdeps = deps.get(folder, {})
        fname = folder_name(folder)
        if folder not in orders:
            order = suggest(entries, fdeps)
            hint = f"`{fname}: {' '.join(order)}`" if order else f"`{fname}: ...` (its entries: {', '.join(sorted(entries))})"
            bad.append(f"{fname}: folder not in {tname}; add the line {hint} (entries bottom up)")
            continue
        order = orders[folder]
        for e in sorted(set(entries) - set(order)):
            below = sorted(fdeps.get(e, set()) & set(order), key=order.index)
            above = sorted((a for a in order if e in fdeps.get(a, set())), key=order.index)
            where = []
            if below:
                where.append(f"after {below[-1]}")
            if above:
                where.append(f"before {above[0]}")
            kind = f"{e}/" if entries[e] == "folder" else f"{e}.rs"
            bad.append(f"{fname}: {kind} is not on the `{fname}:` line of {tname}; add `{e}`"
                       f" {' and '.join(where) if where else 'anywhere'}")
        for e in order:
            if e not in entries:
                bad.append(f"{fname}: `{e}` is listed on the `{fname}:` line of {tname}, but there is no"
                           f" {os.path.join(*(folder + (e,)))}.rs or {os.path.join(*(folder + (e,)))}/; remove it")
        rank = {e: i for i, e in enumerate(order)}
        for a, bs in sorted(fdeps.items()):
            for b in sorted(bs):
                if a in rank and b in rank and rank[b] >= rank[a]:
                    mod, t = example[(folder, a, b)]
                    before = ", ".join(order[: rank[a]]) or "none"
                    bad.append(f"{imp(mod, t)}: on the `{fname}:` line {a} may only import entries before"
                               f" it ({before}), and {b} is not")
        report.append(f"  {fname}: {' < '.join(e for e in order if e in entries)}")

    for folder in sorted(set(orders) - set(folders)):
        fname = folder_name(folder)
        bad.append(f"{fname}: {tname} has a line for it, but no folder {fname} with .rs files exists; remove it")

    for a, b in allow:
        line = f"`allow: {mod_name(a)} {mod_name(b)}` in {tname}"
        if b not in tree.edges.get(a, ()):
            bad.append(f"{line}: {mod_name(a)} does not import {mod_name(b)}; remove the line")
            continue
        n = 0
        while n < len(a) and n < len(b) and a[n] == b[n]:
            n += 1
        order = orders.get(a[:n], [])
        if n < len(a) and n < len(b) and a[n] in order and b[n] in order and order.index(b[n]) < order.index(a[n]):
            bad.append(f"{line}: the `{folder_name(a[:n])}:` line already allows it; remove the line")
        elif n == len(a) or n == len(b):
            bad.append(f"{line}: not an import between entries of one folder; remove the line")
        else:
            report.append(f"  allow {imp(a, b)}: an exception to the order, until reshaped")

    # 2. cycles between modules inside one top-level module (Tarjan's SCC)
    sys.setrecursionlimit(10000)
    inner = {m: {t for t in ts if t and m and t[0] == m[0]} for m, ts in tree.edges.items()}
    for comp in sccs(sorted(tree.modules), inner):
        if len(comp) > 1:
            bad.append("import cycle: " + " <-> ".join(mod_name(c) for c in sorted(comp)))

    # 3. forbidden pairs, both ways
    def under(p):
        return sorted(m for m in tree.modules if m[: len(p)] == p)

    for a, b in forbid:
        ma, mb = under(a), under(b)
        pair = f"{'/'.join(a)} <-> {'/'.join(b)}"
        idle = ["/".join(p) for p, ms in ((a, ma), (b, mb)) if not ms]
        if idle:
            report.append(f"  forbid {pair}: idle ({', '.join(idle)}: no such module yet)")
            continue
        for xs, ys in ((ma, mb), (mb, ma)):
            for x in xs:
                for y in sorted(tree.edges[x]):
                    if y in ys:
                        bad.append(f"{imp(x, y)}: forbidden by `forbid: {'/'.join(a)} {'/'.join(b)}` in {tname}"
                                   " (neither side imports the other)")
        report.append(f"  forbid {pair}: {len(ma)} and {len(mb)} modules, no import between them")

    head = f"layers ok: {len(tree.modules)} modules, {sum(len(v) for v in tree.edges.values())} imports; bottom up, per folder:"
    return sorted(set(bad)), [head] + report


def main(argv):
    args, table = [], DEFAULT_TABLE
    it = iter(argv)
    for a in it:
        if a == "--table":
            table = next(it, None)
            if table is None:
                print("--table needs a file", file=sys.stderr)
                return 2
        elif a.startswith("-"):
            print(__doc__, file=sys.stderr)
            return 2
        else:
            args.append(a)
    src = os.path.normpath(args[0] if args else DEFAULT_SRC)
    try:
        bad, report = check(src, table)
    except TableError as e:
        print(e)
        return 1
    if bad:
        print("\n".join(bad))
        return 1
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
