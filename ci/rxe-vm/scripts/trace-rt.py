#!/usr/bin/env python3
"""Where the half round trips of a traced latency run went (BENCH_PARTS=trace).

    python3 ci/rxe-vm/scripts/trace-rt.py .vm/w/vm-<kernel>-tcg.log

Reads each RXE-TRACE-BEGIN/END section of the VM's log (ftrace's text: the scheduler's
switches, Soft-RoCE's protocol functions, system calls) and cuts it into half round trips: from
one side's post (`rxe_post_send`) to the other side's next post. Each is split into

- flight: from the post to the peer's responder taking the message up (`rxe_receiver`);
- turnaround: from there to the peer's own post, of which the peer spent `off_cpu` switched out
  (the CPU held by Soft-RoCE's workers or another thread) and `on_cpu` running: noticing the
  message, its own code, and the post's system call up to `rxe_post_send`.

Prints the medians per side (the two processes that post most), in microseconds of the guest's
clock (TCG: tens of times a real machine's). The first 10 half round trips are left out.
"""

import re
import statistics
import sys

LINE = re.compile(r"^\s*(.+?)-(\d+)\s+\[(\d+)\]\s+\S+\s+([\d.]+):\s+(.*)$")
SWITCH = re.compile(r"prev_pid=(\d+) .*==> next_comm=.* next_pid=(\d+)")


def sections(path):
    cur, name = None, None
    with open(path, errors="replace") as f:
        for raw in f:
            line = raw.rstrip("\n")
            if line.startswith("RXE-TRACE-BEGIN"):
                cur, name = [], line.split()[1]
            elif line.startswith("RXE-TRACE-END"):
                if cur is not None:
                    yield name, cur
                cur = None
            elif cur is not None:
                m = LINE.match(line)
                if m:
                    cur.append((float(m.group(4)) * 1e6, int(m.group(2)), m.group(5)))


def half_trips(events):
    posts = [(t, pid) for t, pid, ev in events if ev.startswith("rxe_post_send ")]
    count = {}
    for _, pid in posts:
        count[pid] = count.get(pid, 0) + 1
    sides = sorted(count, key=count.get, reverse=True)[:2]
    if len(sides) < 2:
        return sides, []
    posts = [p for p in posts if p[1] in sides]
    arrivals = [t for t, _, ev in events if ev.startswith("rxe_receiver ")]
    # Off-CPU intervals per side, from the switches.
    off = {pid: [] for pid in sides}
    gone = {}
    for t, _, ev in events:
        if "sched_switch:" not in ev:
            continue
        m = SWITCH.search(ev)
        if not m:
            continue
        prev, nxt = int(m.group(1)), int(m.group(2))
        if prev in off and prev != nxt:
            gone[prev] = t
        if nxt in off and nxt in gone:
            off[nxt].append((gone.pop(nxt), t))
    out = []
    ai = 0
    for (t0, a), (t1, b) in zip(posts, posts[1:]):
        if a == b:
            continue
        while ai < len(arrivals) and arrivals[ai] < t0:
            ai += 1
        if ai >= len(arrivals) or arrivals[ai] > t1:
            continue
        arr = arrivals[ai]
        away = sum(max(0.0, min(e, t1) - max(s, arr)) for s, e in off[b])
        out.append((b, t1 - t0, arr - t0, t1 - arr, away))
    return sides, out[10:]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    for name, events in sections(sys.argv[1]):
        sides, trips = half_trips(events)
        if not trips:
            print(f"{name}: no half round trips found (sides {sides})")
            continue
        for pid in sides:
            mine = [x for x in trips if x[0] == pid]
            if not mine:
                continue
            rows = [(x[1], x[2], x[3], x[4], x[3] - x[4]) for x in mine]
            med = [statistics.median(r[i] for r in rows) for i in range(5)]
            print(
                f"{name} pid {pid} (answering {len(mine)}): half_rt={med[0]:.0f} "
                f"flight={med[1]:.0f} turnaround={med[2]:.0f} "
                f"(off_cpu={med[3]:.0f} on_cpu={med[4]:.0f}) usec, medians"
            )


if __name__ == "__main__":
    main()
