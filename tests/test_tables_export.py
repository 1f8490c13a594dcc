"""The tables' export read back, without RPC: table shards write their files with the writer the
PS uses (TableShard.export) and the chief's index (outputs.export_tables); load_tables reads
exactly the files of that export and refuses a missing file, a stale or foreign one, and rows
missing or held twice."""

import json
import shutil
from types import SimpleNamespace as NS

import pytest
import torch

from psrpc.errors import PsrpcError, TablesExportError
from psrpc.ps.tables import TableShard, TableShardSpec
from psrpc.session.outputs import export_tables
from psrpc.sparse import DynamicBag, HashPartition, TableSpec, load_model, load_tables
from psrpc.sparse.export import make_index
from tests.unit_helpers import sgd, sync

SPECS = [TableSpec("user", 10, 4), TableSpec("item", 7, 4, pooling="mean"),
         TableSpec("query", 1000, 4, dynamic=True)]
SPARSE = NS(optimizer="adagrad", lr=0.5, eps=1e-8, weight_decay=0.0, betas=[0.9, 0.999],
            partition="mod", admit_after=1, evict="none", ttl_steps=0, max_rows=None)


def servers(num_ps, seed=0, version=0, specs=SPECS):
    """num_ps table shards, each having trained once on the dynamic ids 0..29 it owns."""
    shards = [TableShard(TableShardSpec(0, torch.empty(0), sgd(lr=1.0), sync(), 1, 1000,
                                        version=version, ps=k, num_ps=num_ps, tables=specs,
                                        seed=seed, sparse=SPARSE))
              for k in range(num_ps)]
    ids = torch.arange(30)
    owner = HashPartition(num_ps).owner(ids)[0]
    for k, shard in enumerate(shards):
        mine = ids[owner == k]
        push = {"query": (mine, torch.full((mine.numel(), 4), float(seed + 1)),
                          torch.ones(mine.numel(), dtype=torch.int64))}
        shard.push_pull(0, version, push, 1.0, 1).wait()
    return shards


def export(out_dir, shards) -> dict:
    """What the chief does at the end of a run, its RPCs to the servers called directly."""
    return export_tables(out_dir, len(shards),
                         lambda export_id: [s.export(str(out_dir), export_id) for s in shards])


def expected(num_ps, seed=0):
    """The rows of an export of `servers(num_ps, seed)`: the fixed tables from one server of
    one (every layout gives the same bits), the dynamic table from the servers' id maps."""
    one = servers(1, seed)[0]
    return {**{n: w.clone() for n, w in one.weights.items()},
            "query": one.dynamic.export("query")}


def assert_rows(tables, want):
    assert tables.keys() == want.keys()
    for name, rows in want.items():
        if isinstance(rows, dict):
            bag = tables[name]
            assert isinstance(bag, DynamicBag)
            order = torch.argsort(rows["ids"])
            assert torch.equal(bag.ids, rows["ids"][order]), name
            assert torch.equal(bag.weight, rows["weight"][order]), name
        else:
            assert torch.equal(tables[name], rows), name


@pytest.mark.parametrize("num_ps", [1, 2, 3])
def test_a_complete_export_loads_every_row_and_its_index_names_the_files(tmp_path, num_ps):
    index = export(tmp_path, servers(num_ps))
    assert_rows(load_tables(tmp_path), expected(num_ps))
    on_disk = json.loads((tmp_path / "tables" / "index.json").read_text())
    assert on_disk == index
    assert index["files"] == [f"ps{k}.pt" for k in range(num_ps)]
    assert index["num_ps"] == num_ps and index["version"] == 1 and len(index["export"]) == 32
    assert index["tables"]["query"]["dynamic"] and index["tables"]["user"]["num_rows"] == 10


def test_a_missing_file_is_named_with_the_files_the_export_wrote(tmp_path):
    export(tmp_path, servers(3))
    (tmp_path / "tables" / "ps1.pt").unlink()  # a PS on another host, no shared storage
    with pytest.raises(TablesExportError, match=r"ps1\.pt is missing: index\.json names ps0\.pt, "
                                                r"ps1\.pt, ps2\.pt \(export \w+, step 1, "
                                                r"num_ps=3\)\. .*copy"):
        load_tables(tmp_path)


def test_a_stale_ps2_of_an_earlier_3_ps_export_is_removed_and_when_copied_back_ignored(
        tmp_path):
    export(tmp_path, servers(3, seed=1))  # an earlier run into the same out_dir
    stale = tmp_path / "stale-ps2.pt"
    shutil.copy(tmp_path / "tables" / "ps2.pt", stale)
    export(tmp_path, servers(2))
    assert sorted(p.name for p in (tmp_path / "tables").iterdir()) == ["index.json", "ps0.pt",
                                                                      "ps1.pt"]
    assert_rows(load_tables(tmp_path), expected(2))
    # the chief's folder is not the one a PS wrote to (no shared storage): the old file stays
    shutil.copy(stale, tmp_path / "tables" / "ps2.pt")
    assert_rows(load_tables(tmp_path), expected(2))


def test_a_file_of_another_export_is_refused(tmp_path):
    """ps1.pt of another run in its place: another num_ps, or the same layout at another step
    (and in both, another export id)."""
    export(tmp_path / "other", servers(3, seed=1))
    export(tmp_path, servers(2))
    shutil.copy(tmp_path / "other" / "tables" / "ps1.pt", tmp_path / "tables" / "ps1.pt")
    with pytest.raises(TablesExportError, match=r"ps1\.pt is not part of the export index\.json "
                                                r"names \(export \w+, step 1, num_ps=2\): it "
                                                r"holds export '\w+', expected '\w+'; num_ps 3, "
                                                r"expected 2\. A file left by another run"):
        load_tables(tmp_path)
    index = export(tmp_path, servers(2))
    late = servers(2, version=4)[1]  # a server at another step, writing into this export
    late.export(str(tmp_path), index["export"])
    with pytest.raises(TablesExportError, match=r"ps1\.pt is not part of the export .*: it "
                                                r"holds version 5, expected 1\."):
        load_tables(tmp_path)


def test_the_chief_writes_no_index_for_files_that_are_not_one_export(tmp_path):
    shards = servers(2)
    written = [s.export(str(tmp_path), "e") for s in shards]
    with pytest.raises(PsrpcError, match=r"expected a file from each of ps0\.\.ps2, got \[0, 1\]"):
        make_index("e", 3, written)
    late = servers(2, version=4)[1].export(str(tmp_path / "late"), "e")
    with pytest.raises(PsrpcError, match=r"ps1 wrote step 5 of 2 servers"):
        make_index("e", 2, [written[0], late])


def _rewrite(path, change):
    part = torch.load(path, weights_only=True)
    change(part)
    torch.save(part, path)


def test_a_dynamic_id_in_two_files_is_refused_naming_both(tmp_path):
    export(tmp_path, servers(2))
    folder = tmp_path / "tables"
    theirs = torch.load(folder / "ps1.pt", weights_only=True)["tables"]["query"]
    one = theirs["ids"][:1]  # an id ps1 holds, copied into ps0's file too

    def add(part):
        t = part["tables"]["query"]
        t["ids"] = torch.cat([t["ids"], one])
        t["weight"] = torch.cat([t["weight"], torch.zeros(1, 4)])

    _rewrite(folder / "ps0.pt", add)
    with pytest.raises(TablesExportError, match=rf"dynamic table 'query': 1 ids are held more "
                                                rf"than once \(ids {int(one)}; id {int(one)} in "
                                                r"ps0\.pt, ps1\.pt\)"):
        load_tables(tmp_path)


def test_a_dynamic_id_on_a_server_that_does_not_own_it_is_refused(tmp_path):
    export(tmp_path, servers(2))

    def move(part):  # ps0's file holding an id ps1 owns, and only there
        t = part["tables"]["query"]
        t["ids"] = torch.cat([t["ids"], torch.tensor([5000 + k for k in range(20) if int(
            HashPartition(2).owner(torch.tensor([5000 + k]))[0]) == 1][:1])])
        t["weight"] = torch.cat([t["weight"], torch.zeros(1, 4)])

    _rewrite(tmp_path / "tables" / "ps0.pt", move)
    with pytest.raises(TablesExportError, match=r"ps0\.pt: dynamic table 'query' holds 1 ids "
                                                r"\(\d+\) that ps0 of 2 does not own"):
        load_tables(tmp_path)


def test_fixed_rows_in_no_file_or_in_two_are_refused(tmp_path):
    export(tmp_path, servers(2))
    folder = tmp_path / "tables"
    ps0 = torch.load(folder / "ps0.pt", weights_only=True)["tables"]["user"]

    def same_as_ps0(part):  # ps1 claims ps0's rows: rows 1, 3, ... in no file, 0, 2, ... twice
        part["tables"]["user"] = ps0

    _rewrite(folder / "ps1.pt", same_as_ps0)
    with pytest.raises(TablesExportError, match=r"table 'user': every row 0\.\.9 must be in "
                                                r"exactly one file of ps0\.pt, ps1\.pt; 5 rows "
                                                r"in no file \(rows 1, 3, 5, 7, 9\) and 5 rows "
                                                r"in more than one file \(rows 0, 2, 4, 6, 8; "
                                                r"row 0 in ps0\.pt, ps1\.pt\)"):
        load_tables(tmp_path)


def test_files_of_an_unfinished_export_without_their_index_are_refused(tmp_path):
    export(tmp_path, servers(2))
    (tmp_path / "tables" / "index.json").unlink()
    with pytest.raises(TablesExportError, match=r"holds no index\.json, which an export writes "
                                                r"last.*did not finish"):
        load_tables(tmp_path)


def _old_layout(folder):
    """The files as psrpc wrote them before the index: no export id, no ps."""
    (folder / "index.json").unlink(missing_ok=True)
    for path in sorted(folder.glob("ps*.pt")):
        _rewrite(path, lambda part: [part.pop("export"), part.pop("ps")])


def test_an_old_layout_folder_loads_only_when_its_files_are_one_export(tmp_path):
    export(tmp_path, servers(2))
    _old_layout(tmp_path / "tables")
    assert_rows(load_tables(tmp_path), expected(2))  # ps0, ps1 of 2 at one step: accepted
    export(tmp_path / "three", servers(3, seed=1))
    _old_layout(tmp_path / "three" / "tables")
    shutil.copy(tmp_path / "three" / "tables" / "ps2.pt", tmp_path / "tables" / "ps2.pt")
    with pytest.raises(TablesExportError, match=r"holds no index\.json \(an export by an older "
                                                r"psrpc\), and its files are not one export: "
                                                r"ps0\.pt \(num_ps=2, step 1\), ps1\.pt \(num_ps="
                                                r"2, step 1\), ps2\.pt \(num_ps=3, step 1\).*Run "
                                                r"it again"):
        load_tables(tmp_path)
    (tmp_path / "tables" / "ps2.pt").unlink()
    (tmp_path / "tables" / "ps1.pt").unlink()
    with pytest.raises(TablesExportError, match=r"not one export: ps0\.pt \(num_ps=2, step 1\);"):
        load_tables(tmp_path)


def test_load_model_refuses_what_load_tables_refuses(tmp_path):
    export(tmp_path, servers(2))
    torch.save({}, tmp_path / "model.pt")
    (tmp_path / "tables" / "ps0.pt").unlink()
    with pytest.raises(TablesExportError, match=r"ps0\.pt is missing"):
        load_model(torch.nn.Module(), str(tmp_path))


def test_no_tables_at_all_is_still_a_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="this run had no tables"):
        load_tables(tmp_path)
