"""Nothing in /dev/shm is trusted: files planted by another local user (made here as `nobody`
with setpriv, so these tests need root and skip otherwise) can neither hang nor break a launch,
nor make psrpc remove or use anything of a live run. And a run stays alive on its host while
its only PS is started again, and the seqlock's in-place reads stay on x86."""

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from psrpc.cluster import shm, shmdir
from psrpc.errors import PsrpcError
from tests.conftest import compose

pytestmark = pytest.mark.timeout(120)
NOBODY = 65534
as_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="planting files as another user needs root (setpriv drops to nobody)")


def as_nobody(script: str) -> None:
    """Run Python `script` as user nobody (another local user)."""
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                    sys.executable, "-c", script], check=True, timeout=60)


@pytest.fixture
def host_shm(monkeypatch):
    """A /dev/shm of the test's own: world-writable and sticky like the real one (outside
    pytest's tmp_path, which only root can enter)."""
    root = Path(tempfile.mkdtemp(prefix="psrpc-test-shm-"))
    os.chmod(root, 0o1777)
    monkeypatch.setattr(shmdir, "SHM_ROOT", root)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _in_thread(fn, timeout_s=10.0):
    """fn() in a thread that must end within `timeout_s` (a blocking open would hang it)."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", fn()), daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"{fn.__name__} blocked for {timeout_s} s"
    return out.get("v")


@as_root
@pytest.mark.parametrize("plant", ["dir", "symlink"])
def test_a_private_directory_planted_by_another_user_is_refused(host_shm, plant):
    """nobody makes /dev/shm/psrpc-<our uid> first (a directory of theirs, or a symlink to
    one): psrpc does not use it; shm=on stops with the reason, auto falls back to TCP."""
    ours = host_shm / f"psrpc-{os.geteuid()}"
    as_nobody(f"import os; os.mkdir('{host_shm}/theirs', 0o777); "
              + (f"os.mkdir('{ours}', 0o777)" if plant == "dir" else
                 f"os.symlink('{host_shm}/theirs', '{ours}')"))
    why = shm.problem()
    assert why and str(ours) in why and (
        "belongs to uid 65534" in why if plant == "dir" else "a symlink" in why)
    with pytest.raises(PsrpcError, match="cannot create shared memory"):
        shm.create(shm.segment(shm.new_run(), 0, "params"), 4, b"n" * shm.NONCE_BYTES)
    cfg = compose(["cluster.shm=on"])
    with pytest.raises(PsrpcError, match="cluster.shm=on but shared memory cannot be used"):
        shm.mode(cfg, True)
    assert shm.mode(compose(["cluster.shm=auto"]), True) is None
    assert shm.remove_stale() == [] and os.listdir(host_shm / "theirs") == []


@as_root
def test_files_planted_in_dev_shm_are_never_touched(host_shm):
    """What another user could plant directly in /dev/shm (a FIFO named like a lock, which
    blocked an O_RDONLY open forever; a lock file of theirs, which made an unlink fail; a lock
    named so that its run parses as a live run's prefix) is outside this user's directory:
    remove_stale returns at once, the live run keeps its files, launches hold their locks."""
    live = shm.new_run()
    as_nobody(f"import os; os.mkfifo('{host_shm}/psrpc-x-ps0.lock'); "
              f"open('{host_shm}/psrpc-{live}-launcher.lock', 'w').close(); "
              f"open('{host_shm}/psrpc-{live}-s0-x.lock', 'w').close()")
    assert shm.problem() is None
    shm.create(shm.segment(live, 0, "params"), 4, b"n" * shm.NONCE_BYTES)
    try:
        shm.hold(live, "launcher")
        assert _in_thread(shm.remove_stale) == []
        assert shm.segment(live, 0, "params") in os.listdir(shm.directory())
    finally:
        shm.release(live)
        shm.remove(live)
    assert sorted(os.listdir(host_shm)) == sorted([
        "psrpc-x-ps0.lock", f"psrpc-{live}-launcher.lock", f"psrpc-{live}-s0-x.lock",
        f"psrpc-{os.geteuid()}"])


@as_root
def test_strange_files_in_the_private_directory_are_logged_and_skipped(host_shm, caplog):
    """Even in this user's directory (where only root could put another user's file) nothing is
    trusted: a FIFO named like a lock does not block, a lock file of another user's is neither
    flocked, held nor removed (its run is kept), a lock name that is no run's is ignored, and a
    file that cannot be removed is logged and skipped."""
    assert shm.problem() is None
    d = shm.directory()
    fifo_run, theirs_run, live = shm.new_run(), shm.new_run(), shm.new_run()
    os.mkfifo(d / f"psrpc-{fifo_run}-ps0.lock")
    theirs = d / f"psrpc-{theirs_run}-ps0.lock"
    theirs.touch()
    os.chown(theirs, NOBODY, NOBODY)
    shm.create(shm.segment(theirs_run, 0, "params"), 4, b"n" * shm.NONCE_BYTES)
    shm.create(shm.segment(live, 0, "params"), 4, b"n" * shm.NONCE_BYTES)
    shm.hold(live, "ps0")
    (d / f"psrpc-{live}-s0-x.lock").touch()  # parsed as run "<live>-s0" before
    (d / shm.segment(live, 0, "g0")).mkdir()  # os.unlink fails on it: EISDIR
    try:
        with caplog.at_level(logging.WARNING, logger="psrpc"):
            removed = _in_thread(shm.remove_stale)
        assert theirs_run not in removed and live not in removed
        assert "not a regular file" in caplog.text and "owned by uid 65534" in caplog.text
        assert {theirs.name, shm.segment(theirs_run, 0, "params"),
                shm.segment(live, 0, "params")} <= set(os.listdir(d))
        with pytest.raises(PsrpcError, match="owned by uid 65534"):
            shm.hold(theirs_run, "ps0")
        with pytest.raises(PsrpcError, match="not a regular file"):
            shm.hold(fifo_run, "ps0")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="psrpc"):
            shm.release(live, remove_files=True)
            assert shm.remove(live) == 1  # its params; the directory is skipped, logged
        assert "could not remove" in caplog.text and shm.segment(live, 0, "g0") in caplog.text
        assert (d / f"psrpc-{live}-s0-x.lock").exists()  # not a name psrpc makes: left alone
    finally:
        shm.release(live)
        for path in [d / f"psrpc-{live}-s0-x.lock", d / f"psrpc-{fifo_run}-ps0.lock", theirs]:
            path.unlink(missing_ok=True)
        (d / shm.segment(live, 0, "g0")).rmdir()
        shm.remove(theirs_run)
        shm.remove(live)


def test_a_run_whose_only_ps_is_restarting_is_alive(monkeypatch, tmp_path):
    """One PS, killed and not yet started again: its lock is free, but the launcher's is held
    (the launcher is alive for the whole run), so another run starting on the host keeps this
    run's segments; once the launcher is gone too, the run is stale."""
    monkeypatch.setattr(shmdir, "SHM_ROOT", tmp_path)
    run = shm.new_run()
    ps = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from psrpc.cluster import shmdir; "
        f"shmdir.SHM_ROOT = shmdir.Path('{tmp_path}'); "
        f"shmdir.hold('{run}', 'ps0'); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        shm.hold(run, "launcher")
        assert ps.stdout.readline().strip() == "held"
        shm.create(shm.segment(run, 0, "params"), 4, b"n" * shm.NONCE_BYTES)
        ps.kill()  # the PS dies; the launcher will start it again
        ps.wait(timeout=10)
        assert shm.remove_stale() == []
        assert shm.segment(run, 0, "params") in os.listdir(shm.directory())
        shm.remove(run)  # the launcher starting the whole group again: its own lock stays
        assert os.listdir(shm.directory()) == [f"psrpc-{run}-launcher.lock"]
        shm.release(run)  # the launcher is gone as well
        assert shm.remove_stale() == [run] and os.listdir(shm.directory()) == []
    finally:
        ps.kill()
        shm.release(run)
        shm.remove(run)


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ppc64le"])
def test_views_are_refused_off_x86(monkeypatch, caplog, machine):
    """Reading the master copy in place (views) relies on x86's store order; elsewhere the
    same run uses slots (parameters in the reply), with a line in the log."""
    cfg = compose(["cluster.shm=auto"])
    assert shm.mode(cfg, True, "x86_64") == "views"
    with caplog.at_level(logging.INFO, logger="psrpc"):
        assert shm.mode(cfg, True, machine) == "slots"
        monkeypatch.setattr(shm.platform, "machine", lambda: machine)
        assert shm.mode(cfg, True) == "slots"
    assert f"slots, not views, on {machine}" in caplog.text
    assert shm.mode(compose(["update=async"]), True, machine) == "slots"
