"""Checkpoint files, the manifest commit point, corrupt-file handling and re-sharding (no RPC)."""

import hashlib
import json
import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from psrpc import checkpoint
from psrpc.checkpoint import restore
from psrpc.checkpoint.manifest import FORMAT as SHARD_FORMAT
from psrpc.cluster.layout import Layout
from tests.unit_helpers import adam, make_shard, push, sgd, sync

SHAPES = {"w": (40, 5), "b": (40,), "v": (7, 3)}


def _saved_run(root, num_shards, steps=6, every=3, optim=None, nan_on_shard=None):
    """Train `num_shards` shards side by side for `steps` rounds, saving every `every`;
    `nan_on_shard` rejects one non-finite gradient first (so the shards' counters differ)."""
    layout = Layout.plan(SHAPES, num_shards, max_shard_bytes=400)
    g = torch.Generator().manual_seed(0)
    start = layout.split({n: torch.randn(s, generator=g) for n, s in SHAPES.items()})
    shards = [make_shard(sync(), optim or sgd(lr=0.1, momentum=0.9), workers=1, start=start[k],
                         n=start[k].numel(), checkpoint_dir=str(root), checkpoint_every=every)
              for k in range(num_shards)]
    for k, sh in enumerate(shards):
        sh.index = k
    if nan_on_shard is not None:
        push(shards[nan_on_shard], 0, 0, torch.full((layout.shard_numel[nan_on_shard],),
                                                    float("nan"))).wait()
    for step in range(steps):
        grads = layout.split({n: torch.full(s, float(step + 1)) for n, s in SHAPES.items()})
        for sh, gr in zip(shards, grads):
            push(sh, 0, step, gr).wait()
    for target in range(every, steps + 1, every):
        infos = [sh.request_save(target).wait() for sh in shards]
        checkpoint.write_manifest(root, target, layout, infos, {"optim": "sgd"})
    for sh in shards:
        sh.close()
    return layout, shards


def test_shards_save_at_every_steps_and_manifest_commits(tmp_path):
    _saved_run(tmp_path, 2)
    assert [s for s, _ in checkpoint.steps_on_disk(tmp_path)] == [6, 3]
    r = checkpoint.find_latest(str(tmp_path))
    assert r.step == 6 and len(r.shards) == 2
    assert "momentum_buffer" in r.shards[0]["optimizer"]["state"][0]


def test_every_rename_and_new_folder_is_made_durable_in_its_folder(tmp_path, monkeypatch):
    """fsync on a file does not cover its name: after each rename (shard files, manifest) and
    each new step folder, the folder holding the new name must be synced too, by that thread
    before it does anything else."""
    events = []  # (thread, what, path), in order
    real_fsync, real_replace, real_link, real_mkdir = os.fsync, os.replace, os.link, Path.mkdir

    def fsync(fd):
        events.append((threading.get_ident(), "fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        real_replace(src, dst)
        events.append((threading.get_ident(), "new name in", str(Path(dst).parent)))

    def mkdir(self, *args, **kwargs):
        real_mkdir(self, *args, **kwargs)
        events.append((threading.get_ident(), "new name in", str(self.parent)))

    def link(src, dst):
        real_link(src, dst)
        events.append((threading.get_ident(), "new name in", str(Path(dst).parent)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(Path, "mkdir", mkdir)
    _saved_run(tmp_path, 2, steps=3, every=3)
    created = [i for i, e in enumerate(events) if e[1] == "new name in"]
    assert len(created) >= 4  # step-3/, 2 shard files, the manifest
    for i in created:
        thread, _, folder = events[i]
        after = next(e for e in events[i + 1:] if e[0] == thread)
        assert after[1:] == ("fsync", folder), (events[i], after)


def test_uncommitted_step_skipped_with_warning_naming_the_file(tmp_path, caplog):
    _saved_run(tmp_path, 2)
    (checkpoint.step_dir(tmp_path, 6) / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING):
        assert checkpoint.find_latest(str(tmp_path)).step == 3
    assert "step-6/manifest.json is missing" in caplog.text


@pytest.mark.parametrize("damage", ["truncate", "garbage", "delete"])
def test_damaged_shard_file_skipped_older_checkpoint_used(tmp_path, caplog, damage):
    _saved_run(tmp_path, 2)
    f = checkpoint.step_dir(tmp_path, 6) / "shard-1.pt"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:100])
    elif damage == "garbage":
        f.write_bytes(b"x" * f.stat().st_size)
    else:
        f.unlink()
    with caplog.at_level(logging.WARNING):
        assert checkpoint.find_latest(str(tmp_path)).step == 3
    assert str(f) in caplog.text


def _set(key, value):
    def change(m):
        m[key] = value
    return change


def _set_entry(k, key, value):
    def change(m):
        m["files"][k][key] = value
    return change


def _set_piece(key, value):
    def change(m):
        m["layout"]["pieces"][0][key] = value
    return change


MALFORMED = {  # name -> a change to step-6's manifest (dict), or its raw bytes
    "not json": b"{step: 6",
    "not utf-8": b"\xff\xfe\x00{",
    "a list": b"[]",
    **{f"no {key}": (lambda key: lambda m: m.pop(key))(key)
       for key in ("format", "step", "num_shards", "layout", "files")},
    "other format": _set("format", "psrpc-checkpoint-0"),
    "step of another folder": _set("step", 5),
    "step as a string": _set("step", "6"),
    "step as a bool": _set("step", True),
    "num_shards 0": _set("num_shards", 0),
    "num_shards as a float": _set("num_shards", 2.0),
    "files not a list": _set("files", {"0": "shard-0.pt"}),
    "one file too few": lambda m: m["files"].pop(),
    "one file too many": lambda m: m["files"].append(dict(m["files"][0])),
    "files out of order": lambda m: m["files"].reverse(),
    "entry not an object": lambda m: m["files"].__setitem__(1, "shard-1.pt"),
    "entry without sha256": lambda m: m["files"][0].pop("sha256"),
    "file ../x": _set_entry(0, "file", "../step-3/shard-0.pt"),
    "file /etc/x": _set_entry(0, "file", "/etc/passwd"),
    "file a/b": _set_entry(0, "file", "sub/shard-0.pt"),
    "file name not a string": _set_entry(0, "file", 0),
    "negative bytes": _set_entry(0, "bytes", -1),
    "bytes as a string": _set_entry(0, "bytes", "100"),
    "sha256 not hex": _set_entry(0, "sha256", "z" * 64),
    "layout not an object": _set("layout", []),
    "layout without pieces": lambda m: m["layout"].pop("pieces"),
    "shapes a list": lambda m: m["layout"].__setitem__("shapes", [[40, 5]]),
    "shape of strings": lambda m: m["layout"]["shapes"].__setitem__("w", ["40", "5"]),
    "piece with an extra key": _set_piece("extra", 1),
    "piece of an unknown tensor": _set_piece("name", "nope"),
    "piece past its shard": _set_piece("offset", 10 ** 6),
    "piece rows reversed": lambda m: m["layout"]["pieces"][0].update(row_start=5, row_end=0),
    "piece numel negative": _set_piece("numel", -1),
    "layout for another shard count": lambda m: m["layout"].update(
        shard_numel=m["layout"]["shard_numel"] + [0], shard_ps=m["layout"]["shard_ps"] + [0]),
    "shard_numel wrong": lambda m: m["layout"]["shard_numel"].__setitem__(0, 1),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_manifest_skipped_with_warning_naming_it(tmp_path, caplog, case):
    _saved_run(tmp_path, 2)
    path = checkpoint.step_dir(tmp_path, 6) / "manifest.json"
    change = MALFORMED[case]
    if isinstance(change, bytes):
        path.write_bytes(change)
    else:
        manifest = json.loads(path.read_text())
        change(manifest)
        path.write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING):
        restored = checkpoint.find_latest(str(tmp_path))
    assert restored is not None and restored.step == 3
    assert f"checkpoint step 6 skipped: {path}" in caplog.text


def test_shard_file_of_another_step_or_optimizer_skipped(tmp_path, caplog):
    """A shard file whose checksum matches its entry but whose content is not what the manifest
    describes (copied from another step, other optimizer state) is skipped too."""
    _saved_run(tmp_path, 2)
    six, three = checkpoint.step_dir(tmp_path, 6), checkpoint.step_dir(tmp_path, 3)
    manifest = json.loads((six / "manifest.json").read_text())
    data = (three / "shard-1.pt").read_bytes()  # step 3's shard 1, under step 6's name
    (six / "shard-1.pt").write_bytes(data)
    manifest["files"][1].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (six / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING):
        assert checkpoint.find_latest(str(tmp_path)).step == 3
    assert f"{six / 'shard-1.pt'} does not match {six / 'manifest.json'}" in caplog.text


def test_step_folder_with_leading_zeros_is_not_a_step(tmp_path):
    _saved_run(tmp_path, 1)
    (tmp_path / "step-6").rename(tmp_path / "step-006")
    assert [s for s, _ in checkpoint.steps_on_disk(tmp_path)] == [3]


def _files(folder):
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir())}


def test_committed_step_is_never_overwritten_by_a_later_run(tmp_path, caplog):
    """A later run (here: other gradients) reaching a step an earlier run committed, e.g. one
    the restore skipped as unreadable, leaves that step's files and manifest alone."""
    _saved_run(tmp_path, 2)
    three = checkpoint.step_dir(tmp_path, 3)
    before = _files(three)
    shard = make_shard(sync(), sgd(lr=0.1), workers=1, n=8, checkpoint_dir=str(tmp_path),
                       checkpoint_every=3)
    with caplog.at_level(logging.WARNING):
        for step in range(3):
            push(shard, 0, step, torch.ones(8)).wait()
        assert shard.request_save(3).wait() is None  # not saved
        shard.close()
    assert _files(three) == before
    assert f"step 3 not saved: {three} already holds a committed checkpoint" in caplog.text
    with pytest.raises(checkpoint.StepCommitted, match=f"{three} already holds"):
        checkpoint.write_manifest(tmp_path, 3, Layout.plan({"w": (8,)}, 1, 400), [{}], {})
    assert _files(three) == before


def _saver(root, start_step=0, every_steps=3):
    from types import SimpleNamespace as NS

    from psrpc.session.saver import CheckpointSaver

    cfg = NS(checkpoint=NS(dir=str(root), every_steps=every_steps, every_s=0, keep=5),
             model={"_target_": "psrpc.models.mlp"}, optim=NS(name="sgd"), update=NS(name="sync"),
             cluster=NS(num_workers=1))
    plan = NS(all_shards=["ps0's shard"], layout=None, table_shards=[], table_specs=[],
              partition="mod")
    return CheckpointSaver(cfg, plan, start_step, margin=1)


def test_saver_does_not_ask_for_a_committed_step(tmp_path, caplog, monkeypatch):
    from psrpc.cluster import comm

    _saved_run(tmp_path, 2)
    asked = []
    monkeypatch.setattr(comm, "invoke", lambda *a, **k: asked.append(a))
    saver = _saver(tmp_path, start_step=3)
    with caplog.at_level(logging.INFO):
        assert saver.save(3).result() is False  # where this run started: kept, no warning
        assert saver.save(6).result() is False  # an earlier run's: kept, with a warning
    saver.final(6)
    assert asked == []
    assert "step 3: this run started from" in caplog.text
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"checkpoint step 6 not made: {checkpoint.step_dir(tmp_path, 6)} already "
                        "holds a committed checkpoint (from an earlier run); committed steps are "
                        "never overwritten"]


def test_saver_writes_the_chiefs_buffers_of_each_step_before_its_manifest(tmp_path, monkeypatch):
    """Buffers (BatchNorm statistics) are taken when the chief reaches the step: at once for an
    every_steps save, later for a step asked ahead (time-based), at the end for the final one;
    buffers.pt is on disk, listed with size and sha256, before the manifest commits the step."""
    from psrpc.cluster import comm
    from psrpc.hooks import StepInfo

    layout = Layout.plan(SHAPES, 2, max_shard_bytes=400)
    shards = [make_shard(sync(), sgd(lr=0.1), workers=1, n=n, checkpoint_dir=str(tmp_path),
                         checkpoint_every=3, steps=7) for n in layout.shard_numel]
    for k, sh in enumerate(shards):
        sh.index = k
    monkeypatch.setattr(comm, "invoke", lambda shard, method, *a, **kw: getattr(shard, method)(*a))
    real_write = checkpoint.write_manifest

    def write_manifest(root, step, layout, files, extra, buffers=None, tables=None):
        data = (checkpoint.step_dir(root, step) / "buffers.pt").read_bytes()
        assert buffers == {"file": "buffers.pt", "bytes": len(data),
                           "sha256": hashlib.sha256(data).hexdigest()}
        real_write(root, step, layout, files, extra, buffers)

    monkeypatch.setattr(checkpoint, "write_manifest", write_manifest)
    chief_at = [0]  # the chief's step: its buffers below say which step they were taken at
    saver = _saver(tmp_path, every_steps=3)
    saver.shards, saver.layout, saver.dense = shards, layout, len(shards)
    saver.buffers = lambda: {"bn.running_mean": torch.tensor([float(chief_at[0])])}
    for step in range(7):
        for sh, n in zip(shards, layout.shard_numel):
            push(sh, 0, step, torch.ones(n)).wait()
        chief_at[0] = step + 1
        saver.after_step(StepInfo(step + 1, 1.0, step + 1, 0, 0.0))
        if step + 1 == 3:
            saver.save(5)  # asked ahead, as a time-based save does
    saver.final(7)
    for sh in shards:
        sh.close()
    for step in (3, 5, 6, 7):
        restored = restore._load_step(step, checkpoint.step_dir(tmp_path, step))
        assert restored.buffers == {"bn.running_mean": torch.tensor([float(step)])}, step


@pytest.mark.parametrize("damage", ["truncate", "delete", "not buffers"])
def test_bad_buffers_file_skips_its_step(tmp_path, caplog, damage):
    _saved_run(tmp_path, 1)
    six = checkpoint.step_dir(tmp_path, 6)
    manifest = json.loads((six / "manifest.json").read_text())
    (six / "manifest.json").unlink()
    entry = checkpoint.save_buffers(tmp_path, 6, {"bn.running_var": torch.ones(3)})
    path = six / "buffers.pt"
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:50])
    elif damage == "delete":
        path.unlink()
    else:  # right checksum, wrong content
        import io
        buf = io.BytesIO()
        torch.save({"format": SHARD_FORMAT, "step": 6, "buffers": [1, 2]}, buf)
        path.write_bytes(buf.getvalue())
        entry.update(bytes=len(buf.getvalue()), sha256=hashlib.sha256(buf.getvalue()).hexdigest())
    manifest["buffers"] = entry
    (six / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING):
        assert checkpoint.find_latest(str(tmp_path)).step == 3
    assert f"checkpoint step 6 skipped: {path}" in caplog.text


def test_restored_buffers_must_be_the_models(caplog):
    from types import SimpleNamespace as NS

    from torch import nn

    from psrpc.errors import PsrpcError
    from psrpc.session.bootstrap import restored_buffers

    cfg = NS(checkpoint=NS(dir="ck"))
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    own = {n: b.clone() + 1 for n, b in model.named_buffers()}
    made = lambda buffers: checkpoint.Restored(40, None, [], {}, buffers)  # noqa: E731
    assert restored_buffers(cfg, model, made(own)) is own
    with pytest.raises(PsrpcError, match=r"step-40 was made for another model \(buffers "
                                         r"differ: \['1.running_mean'\]\)"):
        restored_buffers(cfg, model, made({**own, "1.running_mean": torch.zeros(4)}))
    with caplog.at_level(logging.WARNING):
        assert restored_buffers(cfg, model, made(None)) is None
    assert "step-40 holds no buffers (saved by an older psrpc)" in caplog.text


def test_a_checkpoint_that_does_not_load_never_counts_toward_keep(tmp_path, caplog):
    """keep=1 and a newer committed step whose shard file was truncated since: pruning after
    a new commit must keep the new step (the one that loads), not delete it in favour of the
    corrupt one; the corrupt step is set aside, not deleted, and restore finds the new one."""
    _saved_run(tmp_path, 2, steps=12, every=3)  # steps 3, 6, 9, 12
    shard = checkpoint.step_dir(tmp_path, 12) / "shard-1.pt"
    shard.write_bytes(shard.read_bytes()[:-100])
    for step in (3, 6):
        shutil.rmtree(checkpoint.step_dir(tmp_path, step))
    with caplog.at_level(logging.WARNING):
        checkpoint.prune(tmp_path, keep=1, committed=9, good={9})
    assert [s for s, _ in checkpoint.steps_on_disk(tmp_path)] == [9]
    assert (tmp_path / "step-12.corrupt" / "shard-1.pt").exists()
    assert "step-12 does not load" in caplog.text and "truncated or corrupt" in caplog.text
    assert checkpoint.find_latest(str(tmp_path)).step == 9
    # A step from elsewhere is checked, not trusted: a good one counts, and is remembered.
    good: set = set()
    checkpoint.prune(tmp_path, keep=1, committed=9, good=good)
    assert good == {9} and [s for s, _ in checkpoint.steps_on_disk(tmp_path)] == [9]


def test_prune_keeps_newest_and_drops_stale_partials(tmp_path):
    _saved_run(tmp_path, 1, steps=12, every=3)
    (tmp_path / "step-1").mkdir()  # an abandoned, uncommitted save
    checkpoint.prune(tmp_path, keep=2, committed=12)
    assert [s for s, _ in checkpoint.steps_on_disk(tmp_path)] == [12, 9]


@pytest.mark.parametrize("optim", [sgd(lr=0.1, momentum=0.9), adam()])
@pytest.mark.parametrize("to_shards", [1, 3])
def test_reshard_keeps_params_and_optimizer_state(tmp_path, optim, to_shards):
    layout, shards = _saved_run(tmp_path, 2, optim=optim)
    r = checkpoint.find_latest(str(tmp_path))
    new_layout = Layout.plan(SHAPES, to_shards, 400)
    params, states = checkpoint.reshard(r, new_layout)
    assert new_layout.num_shards == to_shards
    named = new_layout.join(params)
    want = layout.join([s.params for s in shards])
    for n in SHAPES:
        assert torch.equal(named[n], want[n])
    for key, value in shards[0].optimizer.state[shards[0].params].items():
        if value.dim() == 1:  # per-element state follows the parameters
            got = new_layout.join([s[key] for s in states])
            exp = layout.join([sh.optimizer.state[sh.params][key] for sh in shards])
            for n in SHAPES:
                assert torch.equal(got[n], exp[n])
        else:
            assert all(torch.equal(s[key], value) for s in states)


@pytest.mark.parametrize("to_shards", [2, 1, 3])
def test_counters_are_restored_once_not_once_per_shard(tmp_path, to_shards):
    """The summary takes the largest nan_rejected and staleness over shards: after a restore
    each count must be there once, and on a shard that reports it."""
    layout, shards = _saved_run(tmp_path, 2, nan_on_shard=1)
    before = [sh.report() for sh in shards]
    assert [r["nan_rejected"] for r in before] == [0, 1]
    new_layout = layout if to_shards == 2 else Layout.plan(SHAPES, to_shards, 400)
    stats = checkpoint.shard_stats(checkpoint.find_latest(str(tmp_path)), new_layout)
    after = [make_shard(sync(), sgd(), workers=1, n=n, stats=s).report()
             for n, s in zip(new_layout.shard_numel, stats)]
    assert max(r["nan_rejected"] for r in after) == 1
    assert after[0]["samples"] == before[0]["samples"] == 6
    if to_shards != 2:  # re-split: every shard starts from the shared counts (shard 0's)
        assert all(r["samples"] == 6 and r["applied_pushes"] == 6 for r in after)
    else:  # same layout: each shard goes on from exactly its own counters
        counters = ("applied_pushes", "samples", "stale_dropped", "nan_rejected",
                    "max_staleness", "mean_staleness", "per_worker_applied", "per_worker_stale")
        for a, b in zip(after, before):
            assert {k: a[k] for k in counters} == {k: b[k] for k in counters}


def test_checkpoint_for_another_model_is_refused(tmp_path):
    _saved_run(tmp_path, 1)
    r = checkpoint.find_latest(str(tmp_path))
    with pytest.raises(Exception, match="made for another model"):
        checkpoint.reshard(r, Layout.plan({"w": (41, 5), "b": (40,), "v": (7, 3)}, 1, 400))


def test_saver_asks_for_steps_in_increasing_order(monkeypatch):
    """A time-based save asks a few steps ahead; it must not overtake the next every_steps save,
    or committing the later step would prune the earlier one before its manifest is written."""
    from types import SimpleNamespace as NS

    from psrpc.hooks import StepInfo
    from psrpc.session.saver import CheckpointSaver

    cfg = NS(checkpoint=NS(dir="unused", every_steps=10, every_s=1e-9, keep=2),
             model={"_target_": "psrpc.models.mlp"}, optim=NS(name="sgd"), update=NS(name="async"),
             cluster=NS(num_workers=8))
    plan = NS(all_shards=[], layout=None, table_shards=[], table_specs=[], partition="mod")
    saver = CheckpointSaver(cfg, plan, start_step=0, margin=16)
    asked = []
    monkeypatch.setattr(saver, "save", asked.append)
    for step in range(1, 40):
        saver.after_step(StepInfo(step, 1.0, step, 0, 0.0))
    assert asked == sorted(asked) and {10, 20, 30} <= set(asked)
    saver._pool.shutdown()


def _membership_change_during_a_save(tmp_path, monkeypatch, roll_back: bool):
    """Shards train; the saver asks for step 5 ahead (a time-based save); the group ends
    before the shards answer (a rank joined again: RPCs of the old group fail); the new
    epoch lines the same shards up or (a PS was started again) rolls new ones back to the
    committed step 3; training goes on to step 7. Returns the committed steps."""
    from types import SimpleNamespace as NS

    from psrpc.cluster import comm
    from psrpc.hooks import StepInfo

    layout = Layout.plan(SHAPES, 2, max_shard_bytes=400)

    def make(start=None, version=0):
        out = [make_shard(sync(), sgd(lr=0.1), workers=1, n=n, steps=7, version=version,
                          start=None if start is None else start[k],
                          checkpoint_dir=str(tmp_path), checkpoint_every=3)
               for k, n in enumerate(layout.shard_numel)]
        for k, sh in enumerate(out):
            sh.index = k
        return out

    direct = lambda shard, method, *a, **kw: getattr(shard, method)(*a)  # noqa: E731
    old_group = []

    def invoke(shard, method, *a, **kw):  # it reaches the shard; the answer dies with the group
        getattr(shard, method)(*a)
        old_group.append(torch.futures.Future())
        return old_group[-1]

    monkeypatch.setattr(comm, "invoke", direct)
    shards = make()
    saver = _saver(tmp_path, every_steps=3)
    saver.shards, saver.layout, saver.dense = shards, layout, len(shards)
    saver.buffers = lambda: {}

    def train(first, last):
        for step in range(first, last):
            for sh, n in zip(shards, layout.shard_numel):
                push(sh, 0, step, torch.ones(n)).wait()
            saver.after_step(StepInfo(step + 1, 1.0, step + 1, 0, 0.0))

    train(0, 4)
    assert saver.save(3).result() is True
    monkeypatch.setattr(comm, "invoke", invoke)
    saver.save(5)
    for fut in old_group:  # the old group ends (rpc.shutdown(graceful=False))
        fut.set_exception(RuntimeError("RPC is no longer running"))
    monkeypatch.setattr(comm, "invoke", direct)
    if roll_back:  # the PS lost its shards: new ones from step 3
        for sh in shards:
            sh.close()
        restored = checkpoint.find_latest(str(tmp_path))
        assert restored.step == 3
        shards[:] = make([s["params"] for s in restored.shards], version=3)
        saver.rebind(NS(all_shards=shards, table_shards=[]))
        saver.rollback(3)
        train(3, 7)
    else:
        versions = [sh.begin_epoch() for sh in shards]
        for sh in shards:
            sh.catch_up(max(versions))
        saver.rebind(NS(all_shards=shards, table_shards=[]))
        train(4, 7)
    saver.final(7)
    for sh in shards:
        sh.close()
    return [s for s, f in checkpoint.steps_on_disk(tmp_path) if (f / checkpoint.MANIFEST).exists()]


@pytest.mark.parametrize("roll_back", [False, True], ids=["lined-up", "rolled-back"])
def test_a_step_asked_before_a_membership_change_is_committed_after_it(tmp_path, monkeypatch,
                                                                        roll_back):
    """A checkpoint in flight when the group changes is asked again through the new epoch's
    shards (the same ones, or those rolled back to an older step, which reach it again),
    never dropped."""
    assert sorted(_membership_change_during_a_save(tmp_path, monkeypatch, roll_back)) == [
        3, 5, 6, 7]
