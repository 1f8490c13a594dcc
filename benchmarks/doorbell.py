"""How much of a sparse step's round trip is TensorPipe's: the same message (ids and rows of
three tables, as a worker's push and a PS's reply carry them) echoed between two processes of
one host, three ways:

- tensorpipe: `rpc_async` of the tensors, as psrpc sends them (uv transport, default channels);
- doorbell_bytes: the message's bytes in a shared buffer, one FIFO byte each way to say "yours"
  (the floor of a shared-memory transport);
- doorbell_pickled: the same, with the message pickled on one side and unpickled into tensors on
  the other (protocol 5, the tensors' buffers out of band): what a psrpc doorbell would pay.

Idle, and with `load` busy processes beside the two (on 2 cores, 1 makes three processes as in a
2-worker 1-PS cluster).

    python -m benchmarks.doorbell [rows=[510,5100,51000] load=[0,1] repeats=3]
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import pickle
import select
import socket
import statistics
import struct
import sys
import tempfile
import time

import torch

from benchmarks.common import ROOT, bench_config, header, write_results

WAYS = ("tensorpipe", "doorbell_bytes", "doorbell_pickled")


def message(rows: int, dim: int) -> dict:
    """{table: (ids, rows)}: 90 % of the rows in the big table, 5 % in each small one."""
    small = max(1, rows // 20)
    return {f"t{k}": (torch.arange(n, dtype=torch.int64), torch.randn(n, dim))
            for k, n in enumerate([rows - 2 * small, small, small])}


def _dumps(obj) -> tuple[bytes, list]:
    """Pickled with each tensor's bytes out of band (views, no copy)."""
    bufs: list = []
    plain = {k: (i.numpy(), v.numpy()) for k, (i, v) in obj.items()}
    return pickle.dumps(plain, protocol=5, buffer_callback=bufs.append), bufs


def _write(buf, obj) -> None:
    body, bufs = _dumps(obj)
    raws = [b.raw() for b in bufs]
    head = struct.pack(f"<I{len(raws) + 1}I", len(raws), len(body), *(len(r) for r in raws))
    at = len(head)
    buf[:at] = head
    for part in [body, *raws]:
        buf[at:at + len(part)] = part
        at += len(part)


def _read(buf):
    (n,) = struct.unpack_from("<I", buf, 0)
    sizes = struct.unpack_from(f"<{n + 1}I", buf, 4)
    at = 4 + 4 * (n + 1)
    data = bytearray(buf[at:at + sum(sizes)])  # the receiver's own copy
    view, parts, pos = memoryview(data), [], 0
    for s in sizes:
        parts.append(view[pos:pos + s])
        pos += s
    plain = pickle.loads(parts[0], buffers=parts[1:])
    return {k: (torch.from_numpy(i), torch.from_numpy(v)) for k, (i, v) in plain.items()}


def _server(d: str, size: int, pickled: bool) -> None:
    """Echo each request: the bytes copied back, or unpickled into tensors and pickled again."""
    torch.set_num_threads(1)
    req, rep = os.open(f"{d}/req", os.O_RDWR), os.open(f"{d}/rep", os.O_RDWR)
    with open(f"{d}/shm", "r+b") as f:
        buf = mmap.mmap(f.fileno(), 2 * size)
    reply = memoryview(buf)[size:]
    while _wait(req, 600) == b"x":
        if pickled:
            _write(reply, _read(buf))
        else:
            buf[size:2 * size] = buf[0:size]
        os.write(rep, b"r")


def _wait(fd: int, timeout_s: float = 60.0) -> bytes:
    """One byte from a FIFO, or an error when none comes (the other process died)."""
    if not select.select([fd], [], [], timeout_s)[0]:
        raise TimeoutError(f"no doorbell in {timeout_s:.0f} s: the echo process died")
    return os.read(fd, 1)


def doorbell(msg: dict, trips: int, pickled: bool) -> float:
    """Seconds per round trip through FIFOs and a shared buffer."""
    body, bufs = _dumps(msg)
    size = 1024 + len(body) + sum(b.raw().nbytes for b in bufs)
    d = tempfile.mkdtemp(prefix="psrpc-doorbell-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                         else None)
    fds: list[int] = []
    try:
        os.mkfifo(f"{d}/req")
        os.mkfifo(f"{d}/rep")
        with open(f"{d}/shm", "wb") as f:
            f.write(bytes(2 * size))
        server = multiprocessing.get_context("spawn").Process(target=_server,
                                                              args=(d, size, pickled))
        server.start()
        fds += [os.open(f"{d}/req", os.O_RDWR), os.open(f"{d}/rep", os.O_RDWR)]
        req, rep = fds
        with open(f"{d}/shm", "r+b") as f:
            buf = mmap.mmap(f.fileno(), 2 * size)
        raw = os.urandom(size)
        half = memoryview(buf)[size:]
        t0 = 0.0
        for i in range(trips + 20):
            if i == 20:
                t0 = time.perf_counter()
            if pickled:
                _write(buf, msg)
            else:
                buf[0:size] = raw
            os.write(req, b"x")
            _wait(rep)
            if pickled:
                _read(half)
            else:
                bytes(buf[size:2 * size])
        elapsed = time.perf_counter() - t0
        os.write(req, b"q")
        server.join(30)
        return elapsed / trips
    except TimeoutError:
        server.kill()
        raise
    finally:
        for fd in fds:
            os.close(fd)
        for name in ("req", "rep", "shm"):
            try:
                os.unlink(f"{d}/{name}")
            except OSError:
                pass
        os.rmdir(d)


def _echo(x):
    return x


def _rpc_rank(rank: int, port: int, msg: dict, trips: int, out) -> None:
    import torch.distributed.rpc as rpc

    torch.set_num_threads(1)
    rpc.init_rpc(f"r{rank}", rank=rank, world_size=2, rpc_backend_options=(
        rpc.TensorPipeRpcBackendOptions(num_worker_threads=4, _transports=["uv"],
                                        init_method=f"tcp://127.0.0.1:{port}")))
    if rank == 0:
        for _ in range(20):
            rpc.rpc_async("r1", _echo, args=(msg,)).wait()
        t0 = time.perf_counter()
        for _ in range(trips):
            rpc.rpc_async("r1", _echo, args=(msg,)).wait()
        out.put((time.perf_counter() - t0) / trips)
    rpc.shutdown()


def tensorpipe(msg: dict, trips: int) -> float:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [ctx.Process(target=_rpc_rank, args=(r, port, msg, trips, out)) for r in range(2)]
    for p in ranks:
        p.start()
    got = out.get(timeout=300)
    for p in ranks:
        p.join(60)
    return got


def _busy() -> None:
    while True:
        pass


def main(argv: list[str]) -> None:
    b = bench_config("doorbell", argv)
    meta = header()
    rows = []
    for load in b.load:
        busy = [multiprocessing.get_context("spawn").Process(target=_busy, daemon=True)
                for _ in range(load)]
        for p in busy:
            p.start()
        try:
            for n in b.rows:
                msg = message(n, b.dim)
                trips = max(20, b.round_trips * 510 // max(n, 510))  # fewer when larger
                runs: dict[str, list[float]] = {w: [] for w in WAYS}
                for _ in range(b.repeats):
                    runs["tensorpipe"].append(tensorpipe(msg, trips))
                    runs["doorbell_bytes"].append(doorbell(msg, trips, pickled=False))
                    runs["doorbell_pickled"].append(doorbell(msg, trips, pickled=True))
                nbytes = sum(i.numel() * 8 + v.numel() * 4 for i, v in msg.values())
                row = {"load": load, "rows": n, "bytes": nbytes}
                for w in WAYS:
                    row[f"{w}_ms"] = round(1e3 * statistics.median(runs[w]), 3)
                row["tensorpipe_vs_doorbell_pickled"] = round(
                    row["tensorpipe_ms"] / row["doorbell_pickled_ms"], 1)
                rows.append(row)
                print(row, flush=True)
        finally:
            for p in busy:
                p.terminate()
    write_results(ROOT / b.out, meta, rows,
                  ["load", "rows", "bytes", *(f"{w}_ms" for w in WAYS),
                   "tensorpipe_vs_doorbell_pickled"],
                  "A sparse step's message there and back: TensorPipe against a doorbell", plot,
                  notes=("ms: one round trip (the message echoed), the median of "
                         f"{b.repeats} interleaved measurements; load: busy processes beside the "
                         "two. doorbell_pickled pays what a psrpc doorbell would: pickling the "
                         "tensors (out of band), copying them through the shared buffer, "
                         "unpickling them into tensors, both ways."))


def plot(plt, rows):
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for load in sorted({r["load"] for r in rows}):
        rs = [r for r in rows if r["load"] == load]
        for w, style in zip(WAYS, ("o-", "s--", "^-")):
            ax.plot([r["bytes"] for r in rs], [r[f"{w}_ms"] for r in rs], style,
                    label=f"{w}, load {load}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("message bytes")
    ax.set_ylabel("ms per round trip")
    ax.legend(fontsize=7)
    return fig


if __name__ == "__main__":
    main(sys.argv[1:])
