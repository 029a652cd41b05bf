"""NIXL's UCX backend as the baseline of the intra-node transfer bench.

One process per GPU (in one process UCX falls back to TCP): the target registers a buffer on
GPU 1 and publishes it; the initiator on GPU 0 writes its buffer into it, one transfer at a time
(post, then poll until done), and prints one line per size:

    nixl write <bytes> <GB/s> <median us> <backend> [UCX transports]

Usage: python3 nixl_bench.py [--sizes 4096,65536,...] [--seconds 0.3] [--src 0] [--dst 1]
Needs the nixl-cu13 package (import nixl_cu13 or nixl) and torch. Exits 3 when NIXL is missing.
"""

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time


def _nixl():
    try:
        import nixl_cu13 as m  # the CUDA 13 wheel
    except ImportError:
        try:
            from nixl import _api as m  # noqa: F401
        except ImportError:
            return None
    return m


def target(conn, dev, size):
    import torch

    m = _nixl()
    torch.cuda.set_device(dev)
    buf = torch.zeros(size, dtype=torch.uint8, device=f"cuda:{dev}")
    agent = m.nixl_agent("target", m.nixl_agent_config(backends=["UCX"]))
    agent.register_memory(buf)
    conn.send((agent.get_agent_metadata(), buf.data_ptr(), dev))
    conn.recv()  # the initiator is done
    # Check the last write landed: the initiator filled its buffer with 0x5a.
    ok = bool((buf[: min(size, 1 << 20)] == 0x5A).all().item())
    conn.send(ok)


def initiator(conn, dev, sizes, seconds):
    import torch

    m = _nixl()
    torch.cuda.set_device(dev)
    size = max(sizes)
    src = torch.full((size,), 0x5A, dtype=torch.uint8, device=f"cuda:{dev}")
    agent = m.nixl_agent("initiator", m.nixl_agent_config(backends=["UCX"]))
    agent.register_memory(src)
    meta, remote_addr, remote_dev = conn.recv()
    name = agent.add_remote_agent(meta)
    if isinstance(name, bytes):
        name = name.decode()
    for n in sizes:
        local = agent.get_xfer_descs([(src.data_ptr(), n, dev)], "VRAM")
        remote = agent.get_xfer_descs([(remote_addr, n, remote_dev)], "VRAM")
        h = agent.initialize_xfer("WRITE", local, remote, name)
        backend = "?"
        try:
            backend = agent.query_xfer_backend(h)
        except Exception:
            pass

        def once():
            st = agent.transfer(h)
            while st == "PROC":
                st = agent.check_xfer_state(h)
            if st != "DONE":
                raise RuntimeError(f"NIXL transfer state {st}")

        for _ in range(3):
            once()
        times = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or len(times) < 5:
            t = time.perf_counter()
            once()
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        print(f"nixl write {n} {n / med / 1e9:.3f} {med * 1e6:.2f} {backend}", flush=True)
        agent.release_xfer_handle(h)
    conn.send("done")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,65536,1048576,16777216,268435456,1073741824")
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--src", type=int, default=0)
    ap.add_argument("--dst", type=int, default=1)
    a = ap.parse_args()
    if _nixl() is None:
        print("nixl: not installed", file=sys.stderr)
        sys.exit(3)
    sizes = [int(s) for s in a.sizes.split(",")]
    mp.set_start_method("spawn")
    t_conn, i_conn = mp.Pipe()
    t = mp.Process(target=target, args=(t_conn, a.dst, max(sizes)))
    t.start()
    meta = i_conn.recv()
    a_conn, b_conn = mp.Pipe()
    i = mp.Process(target=initiator, args=(a_conn, a.src, sizes, a.seconds))
    i.start()
    b_conn.send(meta)
    b_conn.recv()
    i.join()
    i_conn.send("done")
    ok = i_conn.recv()
    t.join()
    print(f"nixl check {'ok' if ok else 'WRONG BYTES'}", flush=True)
    sys.exit(0 if ok and i.exitcode == 0 else 1)


if __name__ == "__main__":
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    main()
