"""psrpc's all-reduce among the workers of one host (psrpc/cluster/localreduce.py), its ranks as
threads of this process over an in-memory store: the sums and their bits, buffers too large for
the sockets sent by every rank at once, and the clear errors of a peer that closes, says
nothing, or sends a bucket of another size. Over real clusters: tests/test_dense_allreduce.py."""

import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from psrpc.cluster import localreduce
from psrpc.cluster.localreduce import LocalReduceError

pytestmark = pytest.mark.timeout(60)


def _ranks(size: int, body, timeout_s: float = 20.0):
    """Run body(rank, group) on `size` threads, each with its LocalGroup; {rank: result or the
    exception it raised}."""
    store = dist.PrefixStore("t/", dist.HashStore())
    out = {}

    def one(rank):
        try:
            group = localreduce.form(store, rank, size, timeout_s)
            out[rank] = body(rank, group)
        except Exception as e:
            out[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    return out


def _grads(rank: int, step: int, sizes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(n, generator=g) for n in sizes]


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_gets_the_sum_in_rank_order_bit_for_bit(size):
    """Buckets as backward makes them (one over the sockets' buffers: every rank sends it at
    once, nobody reading yet), several steps; every rank ends with x0 + x1 + ... exactly."""
    sizes = [68_416, 256, 2_000_000, 5]

    def body(rank, group):
        got = []
        for step in range(3):
            ts = _grads(rank, step, sizes)
            works = [group.allreduce([t]) for t in ts]
            for w in works:
                w.wait()
            got.append(ts)
        return got

    out = _ranks(size, body)
    for step in range(3):
        want = [_fold([_grads(r, step, sizes)[k] for r in range(size)])
                for k in range(len(sizes))]
        for r in range(size):
            for got, w in zip(out[r][step], want):
                assert torch.equal(got, w)


def _fold(xs):
    total = xs[0].clone()
    for x in xs[1:]:
        total.add_(x)
    return total


def test_workers_on_different_hosts_fall_back_to_gloo():
    """Rank 1 says it is on another host: `form` returns None (the caller makes a gloo group)."""
    store = dist.PrefixStore("t/", dist.HashStore())
    store.set("addr/1", "another-host/boot\n\0nowhere")
    assert localreduce.form(store, 0, 2, 5.0) is None


def test_a_rank_that_cannot_connect_sends_every_rank_to_gloo():
    """Rank 1 finds no listener at rank 0's address (another network namespace): it says so
    in the store, and both return None."""
    store = dist.PrefixStore("t/", dist.HashStore())
    out = {}

    def rank1():
        store.set("addr/0", store.get("addr/0").decode().rsplit("\n", 1)[0] + "\n\0gone")
        out[1] = localreduce.form(store, 1, 2, 5.0)

    def rank0():
        out[0] = localreduce.form(store, 0, 2, 5.0)

    t0 = threading.Thread(target=rank0)
    t0.start()
    while not store.check(["addr/0"]):
        time.sleep(0.01)
    t1 = threading.Thread(target=rank1)
    t1.start()
    t0.join(15)
    t1.join(15)
    assert out == {0: None, 1: None}


def test_a_peer_that_closes_ends_the_wait_at_once_naming_it():
    def body(rank, group):
        if rank == 1:
            group.close()  # as a killed process's sockets are closed by the kernel
            return "closed"
        time.sleep(0.2)
        start = time.monotonic()
        with pytest.raises(LocalReduceError, match="worker 1 is gone"):
            group.allreduce([torch.ones(100_000)]).wait()
        return time.monotonic() - start

    out = _ranks(2, body)
    assert out[1] == "closed"
    assert isinstance(out[0], float) and out[0] < 5, out[0]


def test_a_silent_peer_ends_the_wait_after_the_timeout():
    """...and the error names the timeout as it is set (1.5 s, not a rounded "2 s")."""
    def body(rank, group):
        if rank == 1:
            time.sleep(3)  # alive, sends nothing
            return "silent"
        with pytest.raises(LocalReduceError,
                           match=r"worker\(s\) \[1\] did not complete it in 1\.5 s"):
            group.allreduce([torch.ones(10)]).wait()
        return "timed out"

    assert _ranks(2, body, timeout_s=1.5) == {0: "timed out", 1: "silent"}


def test_forming_gives_up_at_one_deadline_not_a_timeout_per_socket():
    """Rank 1 connects half the timeout in and never says who it is: rank 0 gives up
    timeout_s after it began (the hello's wait gets only the time left), not timeout_s after
    that connection, and says how long it waited."""
    store = dist.PrefixStore("t/", dist.HashStore())
    timeout_s = 1.5
    out = {}

    def rank0():
        start = time.monotonic()
        try:
            out["result"] = localreduce.form(store, 0, 2, timeout_s)
        except LocalReduceError as e:
            out["result"] = e
        out["waited"] = time.monotonic() - start

    t = threading.Thread(target=rank0)
    t.start()
    host, address = store.get("addr/0").decode().split("\n", 1)
    store.set("addr/1", f"{host}\n\0nowhere")  # on this host, so rank 0 waits to accept it
    time.sleep(timeout_s / 2)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(address)  # and sends nothing
    t.join(timeout_s * 4)
    silent.close()
    assert isinstance(out.get("result"), LocalReduceError), out
    assert "timed out after 1.5 s" in str(out["result"])
    assert out["waited"] < timeout_s + 0.4, out["waited"]  # one deadline, not 0.75 + 1.5 s


def test_buckets_of_another_size_are_an_error_not_a_wrong_sum():
    def body(rank, group):
        with pytest.raises(LocalReduceError, match="buckets differ"):
            group.allreduce([torch.ones(10 + rank)]).wait()
        return "refused"

    assert _ranks(2, body) == {0: "refused", 1: "refused"}


def test_a_group_left_out_of_step_refuses_every_later_call():
    """A step abandoned with its all-reduce unfinished leaves the streams out of step: the next
    call fails clearly instead of adding the wrong buffers."""
    def body(rank, group):
        group.allreduce([torch.ones(10)])  # never waited
        assert group.unfinished
        group.break_off("a step was abandoned with its all-reduce unfinished")
        with pytest.raises(LocalReduceError, match="abandoned"):
            group.allreduce([torch.ones(10)])
        return "refused"

    assert _ranks(2, body) == {0: "refused", 1: "refused"}
