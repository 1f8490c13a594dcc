"""The examples in examples/, each as its one command would run it (shortened)."""

import json
import os
import subprocess
import sys

import pytest

from psrpc.api import compose
from tests.conftest import ROOT, read_outputs

pytestmark = pytest.mark.timeout(300)
EXAMPLES = ["-cd", "examples/conf"]


def _run(tmp_path, experiment: str, overrides: list[str]):
    """`python -m psrpc -cd examples/conf +experiment=<name> <overrides>`, through the API."""
    from psrpc.launch import launch
    from psrpc.validate import check_run

    cfg = compose([f"+experiment={experiment}", "train.device=cpu"] + overrides,
                  config_dir="examples/conf", cwd=str(ROOT))
    check_run(cfg)
    launch(cfg, tmp_path, timeout_s=240)
    return read_outputs(tmp_path)


def test_char_lm_beats_the_files_unigram_entropy(tmp_path):
    """Trained on a file of the repository, the model predicts its held-out bytes better than
    their frequencies alone can: context is learnt."""
    from examples.char_lm import unigram_entropy_bits

    text = ROOT / "README.md"
    summary, _ = _run(tmp_path, "char_lm", [f"data.path={text}", "train.steps=150",
                                            "train.eval_every=0", "optim.warmup_steps=10"])
    assert summary["test_bits_per_byte"] < unigram_entropy_bits(str(text))
    assert len((tmp_path / "sample.txt").read_bytes()) >= 300  # the hook's generated sample


def test_regression_with_its_own_metric(tmp_path):
    summary, _ = _run(tmp_path, "regression", ["train.steps=200"])
    assert summary["test_r2"] > 0.8 and summary["final_loss"] < 0.1


def test_cifar_style_cnn_with_augmentation_in_the_dataset(tmp_path):
    summary, _ = _run(tmp_path, "cifar_cnn", ["train.steps=20", "data.size=512",
                                              "data.test_size=128", "data.num_workers=1"])
    assert summary["steps"] == 20 and 0 <= summary["test_accuracy"] <= 1


def test_dynamic_tables_served_without_psrpc_score_the_runs_test_auc(tmp_path):
    """`python examples/dynamic_tables.py`: the rows a run's dynamic tables trained, loaded
    into the model built outside psrpc, score the held-out file as the run's evaluation did,
    with held-out ids that no table has a row for read as their initial values."""
    # `python examples/x.py` puts examples/, not the repository, first on the script's path
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    r = subprocess.run([sys.executable, "examples/dynamic_tables.py", "--out", str(tmp_path),
                        "--steps", "30"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    served = json.loads((tmp_path / "served.json").read_text())
    assert (tmp_path / "heldout.pt").exists() and "held-out AUC" in r.stdout
    assert abs(served["auc"] - summary["test_auc"]) < 1e-5
    assert 0.5 < summary["test_auc"] < summary["hidden_auc"]
    for name, t in served["tables"].items():  # some held-out ids have rows, some read as init
        assert 0 < t["ids_with_row"] < t["ids"], name
        assert summary["tables"][name]["rows_live"] > 0
