#!/usr/bin/env python3
"""Check the module layering of gpudirect/src.

1. Top-level modules: each imports only modules listed above it in LAYERS (lib.rs and the
   test-only modules it declares excepted).
2. Inside every module directory: no two files (modules) reference each other, directly or
   through a longer cycle. A parent's `mod x;` and `pub use x::...` re-exports are not references;
   anything else a file names (`crate::a::b`, `super::x`, `self::x`, `x::` for a child) is.

Exit 1 with one line per violation; prints what it checked otherwise.
"""
import os
import re
import sys

LAYERS = [
    "error", "driver", "completion", "cuda", "memory", "topology",
    "p2p", "rdma", "storage", "transfer", "report",
]

SRC = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "gpudirect", "src")
SRC = os.path.normpath(SRC)

# Top-level modules lib.rs declares only for tests (`#[cfg(test)]`, `#[cfg(all(test, ...))]`):
# fixtures any module's tests may use, no layer of the library (outside tests they do not exist).
TEST_ONLY = set(re.findall(
    r"#\[cfg\((?:test|all\(test\b[^\]]*\))\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;",
    open(os.path.join(SRC, "lib.rs"), encoding="utf-8").read(),
))


def module_path(path):
    """gpudirect/src/rdma/qp.rs -> ('rdma', 'qp'); rdma/mod.rs -> ('rdma',); lib.rs -> ()."""
    rel = os.path.relpath(path, SRC)[:-3].split(os.sep)
    if rel[-1] in ("mod", "lib"):
        rel = rel[:-1]
    return tuple(rel)


def strip(text):
    text = re.sub(r"//[^\n]*", "", text)          # comments (also doc comments)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(\\.|[^"\\])*"', '""', text)  # string literals
    # cfg(test) modules: tests may reach anywhere in their own module
    return text


def test_mod_cut(text):
    m = re.search(r"#\[cfg\(test\)\]\s*mod\s+tests\s*\{", text)
    return text[: m.start()] if m else text


files = {}
for root, _, names in os.walk(SRC):
    for n in names:
        if n.endswith(".rs"):
            p = os.path.join(root, n)
            files[module_path(p)] = test_mod_cut(strip(open(p, encoding="utf-8").read()))
modules = set(files)


def resolve(mod, segs):
    """The longest known module named by path `segs` seen from module `mod`."""
    if not segs:
        return None
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
    best = None
    cur = base
    for s in rest:
        cur = cur + (s,)
        if cur in modules:
            best = cur
        else:
            break
    if best is None and segs[0] in ("crate", "super", "self") and base in modules and base != mod:
        best = base
    return best


def use_paths(text):
    """Every path a file names: `use` trees expanded one level, plus inline a::b:: paths."""
    out = []
    for m in re.finditer(r"\b(pub(\([^)]*\))?\s+)?use\s+([^;]+);", text):
        is_pub = bool(m.group(1))  # `pub use` / `pub(crate) use`: a re-export
        tree = re.sub(r"\s+", "", m.group(3))
        head, _, brace = tree.partition("{")
        heads = [head.rstrip(":")] if not brace else [head.rstrip(":") + "::" + t for t in brace.rstrip("}").split(",") if t]
        for h in heads:
            out.append((h.split("::"), is_pub))
    body = re.sub(r"\b(pub(\([^)]*\))?\s+)?use\s+[^;]+;", "", text)
    for m in re.finditer(r"\b((?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)+)", body):
        out.append((m.group(1).split("::"), False))
    for m in re.finditer(r"(?<![:\w])([a-z_][a-z0-9_]*)::[A-Za-z_]", body):
        out.append(([m.group(1)], False))
    return out


edges = {m: set() for m in modules}
for mod, text in files.items():
    for segs, is_pub in use_paths(text):
        tgt = resolve(mod, segs)
        if tgt is None or tgt == mod:
            continue
        if is_pub and tgt[: len(mod)] == mod:
            continue  # a parent re-exporting a descendant
        edges[mod].add(tgt)

bad = []
# 1. top-level layering
rank = {name: i for i, name in enumerate(LAYERS)}
for mod, tgts in edges.items():
    if not mod:
        continue
    for t in tgts:
        if not t or t[0] == mod[0] or t[0] in TEST_ONLY or mod[0] in TEST_ONLY:
            continue
        a, b = mod[0], t[0]
        if a not in rank or b not in rank:
            bad.append(f"{'/'.join(mod)} -> {'/'.join(t)}: module not in the layer list")
        elif rank[b] >= rank[a]:
            bad.append(f"{'/'.join(mod)} -> {'/'.join(t)}: {a} may only import modules above it ({', '.join(LAYERS[:rank[a]]) or 'none'})")


# 2. cycles between sibling files inside one top-level module (Tarjan's SCC)
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


sys.setrecursionlimit(10000)
inner = {m: {t for t in ts if t and m and t[0] == m[0]} for m, ts in edges.items()}
for comp in sccs(sorted(modules), inner):
    if len(comp) > 1:
        bad.append("import cycle: " + " <-> ".join("/".join(c) for c in sorted(comp)))

if bad:
    print("\n".join(sorted(set(bad))))
    sys.exit(1)
print(f"layers ok: {len(modules)} modules, {sum(len(v) for v in edges.values())} imports, "
      f"top level in order {' < '.join(l for l in LAYERS if (l,) in modules)}")
