#!/usr/bin/env python3
"""KvikIO's figures for benches/storage.rs, measured in the same run on the same files.

The storage bench runs this script (embedded in the bench binary, written to a temporary file)
with the Python found as `python3` (or GPUDIRECT_BENCH_PYTHON) when `import kvikio, cupy` works
there, e.g. with the wheels unpacked into a directory on PYTHONPATH. It prints one JSON object
on its last line of standard output:

    {"kvikio": "26.10.00", "compat_mode": "...", "task_size": 4194304,
     "results": [{"op": "read", "cache": "hot", "variant": "buffered", "threads": 16,
                  "gbps": [43.1, 44.0, 43.6]}, ...],
     "errors": ["..."]}

Cases, each repeated --reps times, thread counts interleaved within a repetition:
  read  hot   file in the page cache (read once first), kvikio.CuFile.read into a cupy array
  read  cold  the file dropped from the page cache (posix_fadvise DONTNEED) before each read;
              variants: KvikIO's default (buffered reads) and auto_direct_io_read on
  write hot   CuFile.write of the array over the existing output file (KvikIO's defaults, which
              write with O_DIRECT where aligned); the file is fdatasync'ed (untimed) first
  write cold  the output file dropped from the page cache first; timed through os.fdatasync

KvikIO runs in compatibility mode (KVIKIO_COMPAT_MODE=ON: its own POSIX path, as gpudirect's
automatic path on a node without nvidia-fs), unless the caller sets the variable otherwise.
"""

import argparse
import json
import os
import sys
import time


def drop_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(path):
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass


def fdatasync_path(path):
    fd = os.open(path, os.O_RDWR)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def write_once(path, buf, cache):
    """One timed write of `buf` over `path`: hot, its earlier writes flushed first (untimed);
    cold, the file dropped from the page cache first and the time taken through fdatasync.
    Returns the bytes written and the seconds."""
    import kvikio

    if cache == "cold":
        drop_cache(path)
    else:
        fdatasync_path(path)
    with kvikio.CuFile(path, "r+") as f:
        t0 = time.perf_counter()
        got = f.write(buf)
        if cache == "cold":
            os.fdatasync(f.fileno())
        s = time.perf_counter() - t0
    return got, s


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", required=True, help="file to read (at least --bytes long)")
    ap.add_argument("--out", required=True, help="file to write (created if absent)")
    ap.add_argument("--bytes", type=int, required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", default="1,4,8,16,32")
    ap.add_argument("--ops", default="read,write")
    ap.add_argument(
        "--serve",
        action="store_true",
        help="run the cases standard input names, one a line (`op cache variant threads`), "
        "each once untimed and once timed; answer each with a line `KV {\"gbps\": x}`",
    )
    args = ap.parse_args()
    os.environ.setdefault("KVIKIO_COMPAT_MODE", "ON")

    import cupy
    import kvikio
    import kvikio.defaults as d

    errors = []

    def get(name, old=None):
        try:
            return d.get(name)
        except Exception:
            f = getattr(d, old or name, None)
            return f() if callable(f) else None

    def setting(name, value, olds=()):
        """Set a KvikIO setting; False if this KvikIO cannot."""
        if hasattr(d, "set"):
            for call in (lambda: d.set(name, value), lambda: d.set({name: value})):
                try:
                    call()
                    return True
                except Exception:
                    pass
        for old in olds:
            f = getattr(d, old, None)
            if callable(f):
                f(value)
                return True
        return False

    def set_threads(n):
        if not setting("num_threads", n, ("num_threads_reset", "set_num_threads")):
            raise RuntimeError("this KvikIO cannot set its thread count")
        got = get("num_threads")
        if got is not None and int(got) != n:
            raise RuntimeError(f"asked KvikIO for {n} threads, it reports {got}")

    n = args.bytes
    threads = [int(t) for t in args.threads.split(",") if t]
    ops = args.ops.split(",")
    buf = cupy.empty(n, dtype=cupy.uint8)
    results = []

    def record(op, cache, variant, t, gbps):
        for r in results:
            if (r["op"], r["cache"], r["variant"], r["threads"]) == (op, cache, variant, t):
                r["gbps"].append(gbps)
                return
        results.append(
            {"op": op, "cache": cache, "variant": variant, "threads": t, "gbps": [gbps]}
        )

    def timed(f):
        t0 = time.perf_counter()
        got = f()
        cupy.cuda.runtime.deviceSynchronize()
        return got, time.perf_counter() - t0

    if args.serve:
        return serve(args, buf, set_threads, setting, timed)

    if "read" in ops:
        # Hot: one check of the bytes (first and last MiB) against the file.
        warm(args.file)
        with kvikio.CuFile(args.file, "r") as f:
            got = f.read(buf)
            if got != n:
                errors.append(f"read returned {got} of {n} bytes")
            with open(args.file, "rb") as h:
                head = h.read(1 << 20)
                h.seek(n - (1 << 20))
                tail = h.read(1 << 20)
            if cupy.asnumpy(buf[: 1 << 20]).tobytes() != head or cupy.asnumpy(
                buf[n - (1 << 20):]
            ).tobytes() != tail:
                errors.append("read: wrong bytes")
            for _ in range(args.reps):
                for t in threads:
                    set_threads(t)
                    _, s = timed(lambda: f.read(buf))
                    record("read", "hot", "buffered", t, n / s / 1e9)
        variants = [("buffered", False)]
        if setting("auto_direct_io_read", False):
            variants.append(("direct", True))
        for _ in range(args.reps):
            for name, direct in variants:
                setting("auto_direct_io_read", direct)
                for t in threads:
                    set_threads(t)
                    drop_cache(args.file)
                    with kvikio.CuFile(args.file, "r") as f:
                        _, s = timed(lambda: f.read(buf))
                    record("read", "cold", name, t, n / s / 1e9)
        setting("auto_direct_io_read", False)

    if "write" in ops:
        if not os.path.exists(args.out) or os.path.getsize(args.out) < n:
            with open(args.out, "ab") as h:
                h.truncate(n)
        direct_w = get("auto_direct_io_write")
        variant = "default" if direct_w is None else ("direct" if direct_w else "buffered")
        for _ in range(args.reps):
            for cache in ("hot", "cold"):
                for t in threads:
                    set_threads(t)
                    got, s = write_once(args.out, buf, cache)
                    if got != n:
                        errors.append(f"write returned {got} of {n} bytes")
                    record("write", cache, variant, t, n / s / 1e9)

    print(
        json.dumps(
            {
                "kvikio": getattr(kvikio, "__version__", "?"),
                "compat_mode": str(get("compat_mode")),
                "task_size": get("task_size"),
                "bounce_buffer_size": get("bounce_buffer_size"),
                "results": results,
                "errors": errors,
            }
        )
    )
    return 0


def serve(args, buf, set_threads, setting, timed):
    """One case at a time, as the bench's paired rounds ask for them (the same preparation as
    the table's cases above); each run once untimed first, as the bench's own cases are."""
    import kvikio

    n = args.bytes
    if not os.path.exists(args.out) or os.path.getsize(args.out) < n:
        with open(args.out, "ab") as h:
            h.truncate(n)

    def once(op, cache, variant, t):
        set_threads(t)
        if op == "read":
            if cache == "cold":
                setting("auto_direct_io_read", variant == "direct")
                drop_cache(args.file)
            with kvikio.CuFile(args.file, "r") as f:
                _, s = timed(lambda: f.read(buf))
            setting("auto_direct_io_read", False)
            return n / s / 1e9
        got, s = write_once(args.out, buf, cache)
        if got != n:
            raise RuntimeError(f"write returned {got} of {n} bytes")
        return n / s / 1e9

    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        try:
            op, cache, variant, t = parts[0], parts[1], parts[2], int(parts[3])
            once(op, cache, variant, t)
            print("KV " + json.dumps({"gbps": once(op, cache, variant, t)}), flush=True)
        except Exception as e:
            print("KV " + json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # one line the bench can print
        print(json.dumps({"fatal": f"{type(e).__name__}: {e}"}))
        sys.exit(1)
