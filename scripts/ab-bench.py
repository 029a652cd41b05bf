#!/usr/bin/env python3
"""A/B of two builds of the transfer_local bench in one call, paired round by round.

    ab-bench.py BEFORE_BIN AFTER_BIN [ROUNDS] [-- BENCH ARGS...]   # default 8 rounds, --quick
    ab-bench.py --one BIN [ROUNDS] [-- BENCH ARGS...]

With --one, one build run ROUNDS times: per cell, the median over runs of the library's rate
over its own run's raw baseline, with the interval (each run pairs the two).

Runs the two binaries alternately (A B, then B A, ...: who goes first rotates), each run printing
its own table with its raw baselines measured beside it. For each cell (size x figure) it prints
the median over rounds of after/before, both for the rate itself (GB/s, adjacent runs) and for the
rate over its own run's raw baseline (which takes the machine's drift between runs out), with
the 95% order-statistic interval of the median from six rounds on (docs/benches.md, "Paired
rounds"). Above 1: the after build is faster. Environment for the bench passes through
(TRANSFER_BENCH_MAX_MIB, GPUDIRECT_BENCH_PYTHON). AB_BUDGET_S: start no round after that many
seconds (the rounds done so far are summarized).
"""
import math
import os
import statistics
import subprocess
import sys
import time

START = time.monotonic()


def over_budget():
    budget = os.environ.get("AB_BUDGET_S")
    return budget is not None and time.monotonic() - START > float(budget)

# Column groups of transfer_local's table rows (separated by `|`): name, or None for a column
# that is a ratio or a difference the bench derives itself.
GROUPS = [
    ["size"],
    ["raw1", "rawipc1", "engine1", None, None, None, "prepared1", None, None, "run1", None, None],
    ["nixl", None],
    ["rawpipe", "ipcpipe", "enginepipe", None, None, "write_on", None, "post_on", None],
    ["rawbatch", "batch1req", None, None],
]
# Each library figure and the raw baseline of the same run it is divided by.
CELLS = [("engine1", "raw1"), ("prepared1", "raw1"), ("run1", "raw1"),
         ("enginepipe", "rawpipe"), ("write_on", "rawpipe"), ("post_on", "rawpipe"),
         ("batch1req", "rawpipe")]


def parse(out):
    rows = {}
    for line in out.splitlines():
        parts = [p.split() for p in line.split("|")]
        if len(parts) != len(GROUPS) or not parts[0] or not parts[0][0][:1].isdigit():
            continue
        size = " ".join(parts[0])
        row = {}
        for names, vals in zip(GROUPS[1:], parts[1:]):
            for n, v in zip(names, vals):
                if n:
                    try:
                        row[n] = float(v)
                    except ValueError:
                        pass
        rows[size] = row
    return rows


def interval(xs):
    """The 95% order-statistic interval of the median of xs (None under six values)."""
    n = len(xs)
    if n < 6:
        return None
    s = sorted(xs)
    k = 0
    for c in range(1, n // 2 + 1):
        p = sum(math.comb(n, i) for i in range(c)) / 2 ** n
        if 2 * p <= 0.05:
            k = c
    return (s[k - 1], s[n - k]) if k else None


def show(xs):
    m = statistics.median(xs)
    iv = interval(xs)
    return f"{m:.3f}" + (f" [{iv[0]:.3f}..{iv[1]:.3f}]" if iv else " [n<6]") + f" n{len(xs)}"


def run(exe, args, who, r):
    """One run of the bench: its parsed table, or None after printing why it failed (its first
    round's whole output is printed too)."""
    p = subprocess.run([exe] + args, capture_output=True, text=True)
    if p.returncode != 0:
        print(f"AB: {who} round {r} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        return None
    if r == 0:
        print(f"--- {who}, first run:\n{p.stdout}")
    return parse(p.stdout)


def one(exe, rounds, args):
    runs = []
    for r in range(rounds):
        if runs and over_budget():
            print(f"AB: out of time after {len(runs)} runs")
            break
        t = run(exe, args, "the build", r)
        if t is None:
            return 1
        runs.append(t)
    print("AB: library over its run's raw baseline, medians over runs [95% interval]")
    print(f"{'size':>8} {'figure':>11} | {'over raw':>26} | {'raw':>8} GB/s")
    for size in runs[0]:
        for lib, raw in CELLS:
            xs = [r[size][lib] / r[size][raw] for r in runs
                  if lib in r.get(size, {}) and raw in r.get(size, {})]
            if xs:
                raws = [r[size][raw] for r in runs if raw in r.get(size, {})]
                print(f"{size:>8} {lib:>11} | {show(xs):>26} | {raw:>8} {statistics.median(raws):.2f}")
    return 0


def main(argv):
    args = argv[argv.index("--") + 1:] if "--" in argv else ["--quick"]
    pos = argv[: argv.index("--")] if "--" in argv else argv
    if pos and pos[0] == "--one":
        return one(pos[1], int(pos[2]) if len(pos) > 2 else 8, args)
    before, after = pos[0], pos[1]
    rounds = int(pos[2]) if len(pos) > 2 else 8
    runs = {"before": [], "after": []}
    for r in range(rounds):
        if runs["after"] and over_budget():
            print(f"AB: out of time after {len(runs['after'])} rounds")
            break
        order = [("before", before), ("after", after)]
        if r % 2:
            order.reverse()
        for who, exe in order:
            t = run(exe, args, who, r)
            if t is None:
                return 1
            runs[who].append(t)
    sizes = list(runs["after"][0])
    print("AB: after/before, medians over rounds [95% interval]; above 1 the after build is faster")
    print(f"{'size':>8} {'figure':>11} | {'rate':>26} | {'rate/raw of its run':>26} | before GB/s  after GB/s")
    for size in sizes:
        for lib, raw in CELLS:
            rate, rel, gb = [], [], {"before": [], "after": []}
            for b, a in zip(runs["before"], runs["after"]):
                if lib in b.get(size, {}) and lib in a.get(size, {}):
                    rate.append(a[size][lib] / b[size][lib])
                    rel.append((a[size][lib] / a[size][raw]) / (b[size][lib] / b[size][raw]))
                    gb["before"].append(b[size][lib])
                    gb["after"].append(a[size][lib])
            if rate:
                print(f"{size:>8} {lib:>11} | {show(rate):>26} | {show(rel):>26} | "
                      f"{statistics.median(gb['before']):>10.2f} {statistics.median(gb['after']):>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
