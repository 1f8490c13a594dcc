"""Membership epochs against a real store, without a cluster: the store decides (an epoch the
launcher announces and the chief ending training exclude each other; an epoch replaced before
every rank arrived is abandoned by every rank), and a join that waits too long says who is
missing. The clusters themselves are in test_elastic.py."""

import dataclasses
import signal
import threading
import time

import pytest

from psrpc.cluster import membership
from psrpc.cluster import store as rendezvous
from psrpc.errors import PsrpcError
from psrpc.launch import free_port

pytestmark = pytest.mark.timeout(60)
NAMES = ["ps0", "worker0", "worker1"]


@pytest.fixture
def store(monkeypatch):
    """The launcher's store, this process a rank of it (ps0 unless a test says)."""
    server = rendezvous.host_store("127.0.0.1", free_port(), 10)
    monkeypatch.setitem(rendezvous._STORES, "current", server)
    before = dataclasses.replace(membership.STATE)
    previous = signal.getsignal(signal.SIGUSR1)
    membership.open_attempt(server, 0)
    membership.setup(0, 0, lambda *a: None, 0, NAMES, timeout_s=1.0)
    membership.CHANGE.clear()
    yield server
    membership.CHANGE.clear()
    membership.STATE.become(before)
    signal.signal(signal.SIGUSR1, previous)


def test_an_epoch_announced_first_is_joined_before_training_may_end(store):
    assert membership.announce(store, 0, 1, ["worker1"])
    assert not membership.finish() and membership.changing()  # the chief joins epoch 1 first
    membership.STATE.epoch = 1
    assert membership.finish()
    assert not membership.announce(store, 0, 2, ["worker1"])  # after it: nobody started again
    assert membership.training_over(store, 0) and membership.announced() == 1


def test_an_epoch_replaced_before_every_rank_arrived_is_abandoned_by_every_rank(store):
    membership.announce(store, 0, 1, ["worker1"])
    threading.Timer(0.3, membership.announce, (store, 0, 2, ["worker0"])).start()
    assert membership._gather(1, time.monotonic() + 5) is False  # ps0 waited, then left
    for rank in (1, 2):  # the others arrive late: all three are there, but it is abandoned
        membership.STATE.rank = rank
        assert membership._gather(1, time.monotonic() + 5) is False


def test_an_epoch_forms_without_a_worker_gone_for_good_and_numbers_the_others_again(store):
    """worker0 was lost with no restart left, then ps0 started again: epoch 1's group is ps0
    and worker1 (ranks 0 and 1 of 2), and it forms once those two arrive."""
    assert membership.announce(store, 0, 1, ["ps0"], gone=["worker0"])
    joined = []
    membership.STATE.join = lambda epoch, abort, rank, world: joined.append((rank, world))

    def ps0_arrives():  # as ps0's own _gather would, in its process
        store.set(membership.gather_key(0, 1, 0), "1")
        if store.add(membership.gather_key(0, 1, "count"), 1) >= 2:
            store.compare_set(membership.gather_key(0, 1, "state"), "", "go")

    membership.STATE.rank = 2  # worker1 arrives first, ps0 0.3 s later
    threading.Timer(0.3, ps0_arrives).start()
    assert membership._join_newest() == 1 and joined == [(1, 2)]
    assert membership.members(1) == [0, 2] and membership.members(0) == [0, 1, 2]
    membership.STATE.rank = 1  # worker0 itself has no place in it
    with pytest.raises(PsrpcError, match=r"^worker0: membership epoch 1 lists it as gone"):
        membership.group_rank(1)


def test_a_rank_missing_from_an_epoch_is_named_after_the_timeout(store):
    membership.STATE.rank = 1
    t0 = time.monotonic()
    with pytest.raises(PsrpcError, match=r"^worker0: membership epoch 0: ps0, worker1 did not "
                                         r"join within 1 s \(cluster.init_timeout_s\)"):
        membership._join_newest()
    assert time.monotonic() - t0 < 5


def _arrive(epoch: int, ranks, formed=()) -> None:
    """Ranks `ranks` arrived at `epoch`'s gathering, which completed; `formed` also said its
    group formed."""
    s = rendezvous.store()
    for r in ranks:
        s.set(membership.gather_key(0, epoch, r), "1")
    s.set(membership.gather_key(0, epoch, "state"), "go")
    for r in formed:
        s.set(membership.gather_key(0, epoch, f"formed/{r}"), "1")


@pytest.mark.parametrize("formed", [True, False], ids=["formed", "never-formed"])
def test_a_rank_maybe_leaving_a_group_that_never_formed_gets_the_time_gloo_may_hold_it(
        store, monkeypatch, formed):
    """gloo's mesh connect holds a rank GLOO_CONNECT_TRIES times the group's timeout when a
    member died as it connected: longer than cluster.init_timeout_s at the next epoch's
    gathering. A missing rank that was at the last epoch's gathering and never said that group
    formed gets that much more, once; one whose group formed (a rank lost) does not."""
    _arrive(0, range(3), formed=range(3))
    _arrive(1, range(3), formed=[0, 1] + ([2] if formed else []))
    monkeypatch.setattr(rendezvous, "GLOO_CONNECT_TRIES", 1)  # (1 s more here, not 1.25)
    membership.STATE.timeout_s = 1.0
    with pytest.raises(PsrpcError, match=r"worker1 did not join within 1 s "
                       r"\(cluster.init_timeout_s\)" + ("$" if formed else
                       r" and 0.25 s more \(what leaving epoch 1's group, which did not form, "
                       r"may take\)$")):
        membership._gather(2, time.monotonic() + 1.0)
    assert membership._leaving(rendezvous.store(), 2, [2]) == (None if formed else 1)
    if not formed:  # the rank arrives within the extra time: the epoch forms
        def arrive_late(r):
            s = rendezvous.store()
            s.set(membership.gather_key(0, 3, r), "1")
            if s.add(membership.gather_key(0, 3, "count"), 1) >= len(NAMES):
                s.compare_set(membership.gather_key(0, 3, "state"), "", "go")
        membership.STATE.rank = 1
        monkeypatch.setattr(rendezvous, "GLOO_CONNECT_TRIES", 8)  # 2 s more
        arrive_late(0)
        late = threading.Timer(1.5, arrive_late, (2,))
        late.start()
        t1 = time.monotonic()
        assert membership._gather(3, t1 + 1.0) is True
        late.join()
        assert time.monotonic() - t1 >= 1.5  # it waited past its 1 s for worker1


def test_a_ps_that_lost_the_chief_waits_for_its_word_longer_than_the_grace(store, monkeypatch):
    """Where the ranks announce epochs (torchrun, srun), a PS whose ping to the chief failed
    waits cluster.init_timeout_s, not the launcher's grace, for an epoch or for the line of a
    chief started again by its engine (a start takes seconds on a busy host): it stops with
    that line, naming the chief, as soon as the line is in the store."""
    from psrpc.cluster import partitions

    membership.STATE.self_announce = True

    membership.STATE.timeout_s = 30.0
    line = "the chief (worker0) was lost and started again: start the job again"
    threading.Timer(1.5, store.set, (membership.failed_key(0), line)).start()
    t0 = time.monotonic()
    with pytest.raises(PsrpcError, match=r"^ps0: the chief \(worker0\) was lost and started"):
        partitions.chief_lost(grace_s=0.5)  # (the word comes after the grace)
    assert 1.0 < time.monotonic() - t0 < 5


def test_a_ps_that_lost_the_chief_joins_an_epoch_announced_meanwhile(store, monkeypatch):
    from psrpc.cluster import partitions

    membership.STATE.self_announce = True

    membership.STATE.timeout_s = 30.0
    threading.Timer(1.0, membership.announce, (store, 0, 1, ["worker0"])).start()
    assert partitions.chief_lost(grace_s=0.5) and membership.changing()


def test_a_rank_whose_store_never_answers_says_so_in_one_line(capfd):
    """A rank started where no store listens (its host gone, or a rank started again after
    the run ended): one line naming the store and cluster.init_timeout_s, not c10d's report."""
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(PsrpcError, match=rf"^the rendezvous store \(127.0.0.1:{port}\) did not "
                                         r"answer within 1 s \(cluster.init_timeout_s\)"):
        rendezvous.connect_store("127.0.0.1", port, 1, 3, timeout_s=1.0)
    assert time.monotonic() - t0 < 5
    assert "TCPStore" not in capfd.readouterr().err


def test_a_chief_that_fails_marks_the_attempt_failed_with_its_line(store, monkeypatch):
    """Under torchrun and srun a chief leaving on an error writes its line where the others
    wait for it (a PS pinging it stops with that line at once, not after a timeout)."""
    from psrpc.cluster import partitions

    monkeypatch.setitem(rendezvous._WHERE, "hosted", True)  # (this process's store: no client)
    membership.STATE.self_announce = True
    membership.STATE.rank = 1  # worker0
    partitions.depart(wait_for_others=False, failed="worker0: the data path is missing")
    assert store.get(membership.failed_key(0)) == \
        b"the chief failed: worker0: the data path is missing"
    assert store.check(["psrpc/attempt-0/left/1"])


def test_the_stores_host_leaves_once_every_rank_has_said_it_leaves(store, monkeypatch):
    """srun's task 0 hosts the store: it waits for the others' word (a rank cut off until the
    end must find there that training is over), and not past it."""
    from psrpc.cluster import partitions

    monkeypatch.setitem(rendezvous._WHERE, "hosted", True)
    membership.STATE.self_announce = True
    membership.STATE.timeout_s = 30.0
    for rank, after_s in ((1, 0.3), (2, 1.0)):
        threading.Timer(after_s, store.set, (f"psrpc/attempt-0/left/{rank}", "1")).start()
    t0 = time.monotonic()
    partitions.depart()
    assert 0.9 < time.monotonic() - t0 < 5
