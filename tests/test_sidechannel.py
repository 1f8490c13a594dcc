"""The side channel of colocated ranks (psrpc/cluster/sidechannel.py): calls and results cross
intact, errors come back as errors, nothing waits past its timeout or past a dead peer, and only
this user's processes are served. A cluster's table pushes through it give the bits they give
over TensorPipe (tests/test_sparse_cluster.py)."""

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch.futures import Future

from psrpc.cluster import comm, sidechannel
from psrpc.cluster.wire import Reply
from psrpc.errors import PsrpcError

pytestmark = pytest.mark.timeout(60)


class Tables:
    """Stands for a table shard: answers at once, later, never, or with an error."""

    def __init__(self):
        self.later: list[Future] = []

    def push(self, rows, grads):
        return Reply(version=int(rows.sum()), params=torch.zeros(0), accepted=True,
                     finished=False, loss=0.5, samples=rows.numel(), stale_dropped=0,
                     rows={"t": grads * 2, "half": grads.to(torch.bfloat16)})

    def wait(self):
        fut = Future()
        self.later.append(fut)
        return fut

    def fail(self):
        raise ValueError("row 7 out of range [0, 5)")


@pytest.fixture(scope="module")
def served():
    key = 987_001
    comm.register(key, Tables())
    address, host = sidechannel.listen()
    assert host == sidechannel.host_id() and address.startswith("\0psrpc-")
    yield comm.Handle("ps-test", key), address
    comm.registered().pop(key)


def test_calls_and_results_cross_intact_in_one_message(served):
    handle, address = served
    ch = sidechannel.SideChannel("ps-test", address, timeout_s=10)
    rows, grads = torch.tensor([1, 2, 4]), torch.randn(3, 4)
    got = ch.invoke_many([(handle, "push", (rows, grads)),
                          (handle, "push", (rows[:1], grads[:1]))]).wait()
    assert [r.version for r in got] == [7, 1] and got[0].samples == 3
    assert torch.equal(got[0].rows["t"], grads * 2) and got[0].rows["t"].dtype == torch.float32
    assert got[0].rows["half"].dtype == torch.bfloat16  # (left to pickle's own path)
    ch.close()


def test_a_call_that_raises_fails_its_future_with_that_error(served):
    handle, address = served
    ch = sidechannel.SideChannel("ps-test", address, timeout_s=10)
    with pytest.raises(ValueError, match=r"row 7 out of range \[0, 5\)"):
        ch.invoke_many([(handle, "push", (torch.ones(1), torch.ones(1, 2))),
                        (handle, "fail", ())]).wait()
    ch.close()


def test_a_reply_that_comes_later_arrives_and_one_that_never_comes_times_out(served,
                                                                          monkeypatch):
    handle, address = served
    monkeypatch.setattr(sidechannel, "POLL_S", 0.05)
    ch = sidechannel.SideChannel("ps-test", address, timeout_s=0.5)
    later = ch.invoke_many([(handle, "wait", ())])
    tables = comm.registered()[handle.key]
    for _ in range(100):
        if tables.later:
            break
        time.sleep(0.01)
    threading.Timer(0.1, tables.later.pop().set_result, args=("round closed",)).start()
    assert later.wait() == ["round closed"]
    t0 = time.monotonic()
    with pytest.raises(PsrpcError, match="no reply from ps-test within 0.5 s"):
        ch.invoke_many([(handle, "wait", ())]).wait()
    assert time.monotonic() - t0 < 3
    ch.close()
    with pytest.raises(PsrpcError, match="the side channel to ps-test is closed"):
        ch.invoke_many([(handle, "push", (torch.ones(1), torch.ones(1, 2)))]).wait()


SERVER = """
import sys, time
from psrpc.cluster import comm, sidechannel
from torch.futures import Future
class Never:
    def wait(self):
        return Future()
comm.register(5, Never())
print(sidechannel.listen()[0][1:], flush=True)
time.sleep(60)
"""


def test_calls_in_flight_fail_at_once_when_the_ps_process_dies():
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        address = "\0" + server.stdout.readline().strip()
        ch = sidechannel.SideChannel("ps-test", address, timeout_s=30)
        pending = ch.invoke_many([(comm.Handle("ps-test", 5), "wait", ())])
        time.sleep(0.2)
        t0 = time.monotonic()
        server.kill()
        with pytest.raises(PsrpcError, match="the side channel to ps-test closed: ps-test is gone"):
            pending.wait()
        assert time.monotonic() - t0 < 5  # the end of the socket, not the 30 s timeout
    finally:
        server.kill()
        server.wait()


SENDER = """
import os, sys, torch
from psrpc.cluster import comm, sidechannel
ch = sidechannel.SideChannel("ps-test", "\\0" + sys.argv[1], timeout_s=30)
for i in range(20):
    assert ch.send([(comm.Handle("ps-test", int(sys.argv[2])), "take", (i, torch.full((3,), i)))])
os.kill(os.getpid(), 9)  # at once: most of them still wait in the receiver's socket
"""


class Log:
    def __init__(self):
        self.got = []

    def take(self, i, t):
        time.sleep(0.02)  # (slower than the sender: the socket holds the rest)
        assert torch.equal(t, torch.full((3,), i))
        self.got.append(i)


def test_messages_with_no_reply_are_all_taken_when_their_sender_was_killed(served):
    """What a primary sent its backup before SIGKILL is in the backup's socket: `settle` (a
    promotion's first step) returns once every one of them was taken, in order."""
    _, address = served
    key, log = 987_002, Log()
    comm.register(key, log)
    try:
        out = subprocess.run([sys.executable, "-c", SENDER, address[1:], str(key)],
                             env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=60,
                             capture_output=True, text=True)
        assert out.returncode == -9, out.stderr
        assert len(log.got) < 20  # (some still queued when the sender died)
        sidechannel.settle(timeout_s=10)
        assert log.got == list(range(20))
    finally:
        comm.registered().pop(key)


def test_a_call_with_no_reply_that_fails_closes_the_channel_so_its_sender_learns(served):
    handle, address = served
    ch = sidechannel.SideChannel("ps-test", address, timeout_s=10)
    assert ch.send([(handle, "fail", ())])
    t0 = time.monotonic()
    with pytest.raises(PsrpcError, match="side channel to ps-test"):
        while time.monotonic() - t0 < 5:
            ch.send([(handle, "push", (torch.ones(1), torch.ones(1, 2)))])
            time.sleep(0.01)
    ch.close()


CLIENT = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\\0" + sys.argv[1])
s.settimeout(10)
print("refused" if s.recv(1) == b"" else "served")
"""


SYSTEM_PYTHON = "/usr/bin/python3"  # (one that user nobody may run)


@pytest.mark.skipif(os.getuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                    reason="needs root and a system Python to run a client as another user")
def test_a_process_of_another_user_is_refused(served):
    _, address = served
    out = subprocess.run([SYSTEM_PYTHON, "-I", "-c", CLIENT, address[1:]], capture_output=True,
                         text=True, timeout=30, cwd="/", preexec_fn=lambda: os.setuid(65534))
    assert out.stdout.strip() == "refused", out.stderr


def test_dumps_keeps_values_types_and_dataclasses():
    reply = Reply(version=3, params=torch.arange(4.0), accepted=True, finished=False, loss=None,
                  samples=1, stale_dropped=0, rows={"a": torch.tensor([[1.0, 2.0]]),
                                                    "h": torch.ones(2, dtype=torch.bfloat16)})
    step = torch.tensor(7.0)  # (a 0-dim tensor: Adam's step count)
    back = sidechannel.pickle.loads(sidechannel.dumps(
        (reply, [torch.tensor([5], dtype=torch.int64)], torch.arange(6.0)[1::2], step)))
    assert back[0].version == 3 and torch.equal(back[0].params, torch.arange(4.0))
    assert torch.equal(back[0].rows["a"], torch.tensor([[1.0, 2.0]]))
    assert back[0].rows["h"].dtype == torch.bfloat16 and back[0].rows["h"].tolist() == [1, 1]
    assert back[1][0].dtype == torch.int64 and isinstance(back[1], list)
    assert back[2].tolist() == [1.0, 3.0, 5.0] and back[3].dim() == 0 and back[3].item() == 7


def test_dumps_stops_as_soon_as_the_tensors_pass_the_limit():
    """A large shard's update (tens of MB) is not pickled whole only to learn it is large:
    the pickler stops at the tensor that crosses the limit."""
    small, big, after = torch.ones(100), torch.ones(1000), torch.ones(10**6)
    with pytest.raises(sidechannel.Large) as e:
        sidechannel.dumps([small, {"b": big}, after], limit=1000)
    assert e.value.args[0] == 400 + 4000  # counted up to `big`; `after` never reached
    assert len(sidechannel.dumps([small], limit=1000)) < 1000


def test_a_message_over_the_large_mark_goes_over_tensorpipe(served, monkeypatch):
    handle, address = served
    ch = sidechannel.SideChannel("ps-test", address, timeout_s=10)
    sent = []
    monkeypatch.setattr(sidechannel.comm, "invoke_many",
                        lambda calls, timeout_s=None: sent.append(calls) or "tensorpipe")
    monkeypatch.setattr(sidechannel, "LARGE", 10_000)
    small = [(handle, "push", (torch.ones(2, dtype=torch.int64), torch.ones(2, 4)))]
    large = [(handle, "push", (torch.ones(2, dtype=torch.int64), torch.ones(2, 4096)))]
    assert ch.invoke_many(small).wait()[0].samples == 2 and sent == []
    assert ch.invoke_many(large) == "tensorpipe" and sent == [large]
    ch.close()


def test_leaving_the_rpc_group_fails_the_calls_in_flight_as_rpc_does(served):
    """A membership epoch: every rank leaves its group (comm.shutdown, comm.abandon), and what
    went beside RPC ends with it; the next group's client reaches the same listener again."""
    handle, address = served
    ch = sidechannel.SideChannel("ps-test", address, timeout_s=30)
    sidechannel._open["ps-test"] = ch
    pending = ch.invoke_many([(handle, "wait", ())])
    time.sleep(0.1)
    comm.abandon()  # (no RPC agent here: only what travels beside it)
    with pytest.raises(PsrpcError, match="it left its RPC group"):
        pending.wait()
    again = sidechannel.SideChannel("ps-test", address, timeout_s=10)
    assert again.invoke_many([(handle, "push", (torch.ones(1), torch.ones(1, 2)))]).wait()
    again.close()


def test_a_reply_stream_that_makes_no_sense_closes_the_channel_and_fails_its_calls():
    """Whatever the reader cannot read (here: a reply that does not unpickle) ends the channel:
    the calls waiting fail at once and later ones too, rather than waiting forever."""
    import socket
    import struct

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = "\0psrpc-test-garbage-%d" % os.getpid()
    server.bind(address)
    server.listen(1)
    ch = sidechannel.SideChannel("ps-test", address, timeout_s=30)
    conn, _ = server.accept()
    pending = ch.invoke_many([(comm.Handle("ps-test", 1), "push", ())])
    conn.sendall(struct.pack("<QQ", 5, 1) + b"\x80\x05junk")
    t0 = time.monotonic()
    with pytest.raises(PsrpcError, match="closed: ps-test is gone"):
        pending.wait()
    assert time.monotonic() - t0 < 5
    with pytest.raises(PsrpcError, match="is closed"):
        ch.invoke_many([(comm.Handle("ps-test", 1), "push", ())]).wait()
    conn.close()
    server.close()
