"""Data parallel runs: 2 CPU processes (gloo) through ``accelerate launch`` give the files
one process writes, row for row, and a run resumes from the parts a dead process left."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import save_tiny

from contribution_weights.cli import main

TEXTS = [
    "the cat sat on the mat and looked at the dog",
    "water boils at one hundred degrees",
    "x",
    "one two three four five six seven",
    "a b",
    "colourless green ideas sleep furiously",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    model = save_tiny("llama", root / "model")
    (root / "texts.txt").write_text("\n\n".join(TEXTS))
    return root, model


def launch(args: list[str], processes: int = 2) -> subprocess.CompletedProcess:
    """``accelerate launch`` of ``python -m contribution_weights`` on CPU processes."""
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    assert accelerate is not None, "accelerate is a dependency of this package"
    cmd = [
        accelerate, "launch", "--multi_gpu", "--num_processes", str(processes),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", "0", "-m", "contribution_weights", *args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _faith_args(root: Path, model: Path, out: str) -> list[str]:
    return ["faithfulness", "--file", str(root / "texts.txt"), "--model", str(model),
            "--measures", "attention,ihc", "--rates", "0.2,0.5",
            "--out", str(root / out)]  # fmt: skip


def test_two_processes_write_the_one_process_files_row_for_row(setup):
    root, model = setup
    assert main(_faith_args(root, model, "one")) == 0
    launch(_faith_args(root, model, "two"))
    for name in ("per_sequence.csv", "summary.csv", "skipped.jsonl", "config.json"):
        assert (root / "two" / name).read_text() == (root / "one" / name).read_text(), name
    assert not (root / "two" / "parts").exists()
    import json

    info = json.loads((root / "two" / "run_info.json").read_text())
    assert info["processes"] == 2 and [s["unit"] for s in info["skipped"]] == [2]


def test_resume_merges_the_parts_a_dead_process_left(setup):
    """A dead process leaves its part (a unit cut mid-write last); --resume merges the
    finished units and redoes only the rest, ending with the one-process files."""
    root, model = setup
    one = root / "one"
    if not one.exists():
        assert main(_faith_args(root, model, "one")) == 0
    cut = root / "cut"
    shutil.copytree(one, cut)
    for name in ("summary.csv", "run_info.json"):
        (cut / name).unlink()
    lines = (one / "per_sequence.csv").read_text().splitlines(keepends=True)
    header, body = lines[0], lines[1:]
    by_seq: dict[str, list[str]] = {}
    for line in body:
        by_seq.setdefault(line.split(",", 1)[0], []).append(line)
    seqs = sorted(by_seq, key=int)  # 0, 1, 3, 5
    (cut / "per_sequence.csv").write_text(header + "".join(by_seq[seqs[0]]))
    part = cut / "parts" / "1"
    part.mkdir(parents=True)
    # process 1 finished sequence 1 and died writing sequence 3 (half its second row)
    cut_row = by_seq[seqs[2]][1][: len(by_seq[seqs[2]][1]) // 2]
    (part / "per_sequence.csv").write_text(
        header + "".join(by_seq[seqs[1]]) + by_seq[seqs[2]][0] + cut_row
    )
    (cut / "skipped.jsonl").unlink()
    launch([*_faith_args(root, model, "cut"), "--resume"])
    for name in ("per_sequence.csv", "summary.csv", "skipped.jsonl"):
        assert (cut / name).read_text() == (one / name).read_text(), name
    assert not (cut / "parts").exists()


def _close(a, b, path=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-12), path
    else:
        assert a == b, path


def test_two_process_geometry_gives_the_one_process_tables(setup):
    import json

    root, model = setup
    args = ["geometry", "--file", str(root / "texts.txt"), "--model", str(model),
            "--cap", "300", "--gammas", "1,0.5,0", "--sink-layers", "1"]  # fmt: skip
    assert main([*args, "--out", str(root / "g1")]) == 0
    launch([*args, "--out", str(root / "g2")])
    one = json.loads((root / "g1" / "tables.json").read_text())
    two = json.loads((root / "g2" / "tables.json").read_text())
    # sampled points are the same sample: the regressions agree exactly
    assert two["regression_r2"] == one["regression_r2"]
    assert two["log_regression_r2"] == one["log_regression_r2"]
    _close(two, one)  # sums over sequences in another order: float rounding
    for name in ("sink_scaling.csv", "config.json"):
        assert (root / "g2" / name).read_text() == (root / "g1" / name).read_text(), name
    assert not (root / "g2" / "parts").exists()


def test_two_process_kv_eval_gives_the_one_process_rows(setup):
    """kv-eval runs on the same runner: items dealt over two processes give the rows and
    summaries of one process (all but the prefill's wall time)."""
    import json

    import pandas as pd

    root, model = setup
    args = ["kv-eval", "--task", "passkey", "--model", str(model), "--n", "3",
            "--context-tokens", "256", "--methods", "h2o,contribution_sinks",
            "--ratios", "0,0.5"]  # fmt: skip
    assert main([*args, "--out", str(root / "k1")]) == 0
    launch([*args, "--out", str(root / "k2")])
    one, two = (pd.read_csv(root / k / "per_item.csv") for k in ("k1", "k2"))
    wall = ["prefill_s", "compress_s"]  # wall times
    one, two = one.drop(columns=wall), two.drop(columns=wall)
    assert len(one) == 9 and one["item"].nunique() == 3
    pd.testing.assert_frame_equal(two, one)
    for name in ("summary_paired.csv", "config.json"):
        assert (root / "k2" / name).read_text() == (root / "k1" / name).read_text(), name
    for name in ("summary.csv", "summary_depth.csv"):  # all but the mean wall times
        a, b = (pd.read_csv(root / k / name).drop(columns="compress_s") for k in ("k1", "k2"))
        pd.testing.assert_frame_equal(b, a)
    assert not (root / "k2" / "parts").exists()
    info = json.loads((root / "k2" / "run_info.json").read_text())
    assert info["processes"] == 2 and info["units"] == {"kv-eval": 3} and info["finished"]
