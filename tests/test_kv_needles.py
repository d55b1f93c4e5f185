"""benchmarks/kv_needles.py on a tiny RULER run: items regenerated and checked, each asked
needle found or not as the output says, and the kept sets it reads add up to the budget."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from benchmark_scripts import load_benchmark

from contribution_weights import kv

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kv_needles.py"
TASK = "niah_multivalue"


def _script() -> Any:
    return load_benchmark("kv_needles")


@pytest.fixture(scope="module")
def run(tmp_path_factory: Any, fixture_data: Path) -> Path:
    """``cw kv-eval --task ruler`` on a tiny saved model whose character tokenizer decodes
    back exactly (the needles must survive tokenisation): 2 items, both settings."""
    from tiny_models import char_tokenizer_fast, save_tiny
    from tokenizers import decoders

    from contribution_weights.cli import main

    root = tmp_path_factory.mktemp("needles")
    folder = save_tiny("llama", root / "model")
    tok = char_tokenizer_fast()
    tok.backend_tokenizer.decoder = decoders.Fuse()  # "a", "b" decode to "ab", not "a b"
    tok.save_pretrained(folder)
    code = main(["kv-eval", "--task", "ruler", "--ruler-tasks", TASK, "--model", str(folder),
                 "--data-dir", str(fixture_data), "--context-tokens", "768", "--n", "2",
                 "--setting", "both", "--ratios", "0,0.5", "--methods", "streaming_llm,snapkv",
                 "--window", "8", "--out", str(root / "run")])  # fmt: skip
    assert code == 0
    return root / "run"


def _items(run: Path, fixture_data: Path) -> tuple[Any, Any, Any]:
    import json

    from contribution_weights import data, load_model
    from contribution_weights.cli.experiment_cmd import HAYSTACK_TEXTS
    from contribution_weights.experiments.kv_eval import KVEvalResult
    from contribution_weights.kv.ruler import RulerGenerator

    config = json.loads((run / "config.json").read_text())
    texts = data.load_texts("fineweb-edu", HAYSTACK_TEXTS, fixture_data)
    generator = RulerGenerator(load_model(config["model"]).tokenizer, texts)
    rows = KVEvalResult.load(run).per_item
    return generator, rows, config


def test_each_asked_needle_is_found_as_the_output_says(run: Path, fixture_data: Path) -> None:
    script = _script()
    generator, rows, config = _items(run, fixture_data)
    items, regenerated = script.regenerate(generator, rows, TASK, config)
    assert sorted(items) == sorted(set(rows["item"]))
    for index, item in items.items():
        answers = regenerated[index].answers
        assert sorted(v for v, _ in item["asked"]) == sorted(a.lower() for a in answers)
        depths = [d for _, d in item["asked"]]
        assert depths == sorted(depths) and all(0 <= d <= 1 for d in depths)
        assert set(answers) <= set(item["values"])
    # an output naming the first and third asked values, and one value with a digit changed
    row = rows.iloc[[0]].copy()
    asked = items[int(row["item"].iloc[0])]["asked"]
    wrong = asked[1][0][:-1] + str((int(asked[1][0][-1]) + 1) % 10)
    row["output"] = f"- {asked[0][0]}\n- {asked[2][0]}\n- {wrong}"
    found = [r["found"] for r in script.needle_rows(row, items)]
    assert found == [1.0, 0.0, 1.0, 0.0]
    made = script.invented(row, items)[0]
    assert (made["invented"], made["garbled"]) == (1, 1)
    # answers that differ from the regenerated item's: refused, not silently misread
    bad = rows.copy()
    bad.loc[bad["item"] == bad["item"].iloc[0], "answers"] = "1234567|7654321"
    with pytest.raises(SystemExit, match="regenerated answers"):
        script.regenerate(generator, bad, TASK, config)


def test_the_script_writes_its_tables_and_kept_sets_that_fill_the_budget(
    run: Path, fixture_data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--run", str(run), "--task", TASK, "--data-dir",
         str(fixture_data), "--out", str(out), "--kept", "2", "--kept-settings",
         "query_agnostic,query_aware", "--kept-figure", str(tmp_path / "kept.png")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("", "-early-late", "-invented", "-kept"):
        assert (out / f"kv-needles-{TASK}{name}.csv").exists(), name
    assert (tmp_path / "kept.png").stat().st_size > 0
    recall = pd.read_csv(out / f"kv-needles-{TASK}.csv")
    assert set(recall["method"]) == {"none", "streaming_llm", "snapkv"}
    rows = pd.read_csv(run / "per_item.csv")
    kept = pd.read_csv(out / f"kv-needles-{TASK}-kept.csv")
    assert set(kept["setting"]) == {"query_agnostic", "query_aware"}
    assert set(kept["method"]) == {"streaming_llm", "snapkv"} and set(kept["ratio"]) == {0.5}
    tokens = rows.groupby(["item", "setting"])["prefill_tokens"].first()
    for (item, setting, method, ratio), g in kept.groupby(["item", "setting", "method", "ratio"]):
        t = int(tokens[(item, setting)])
        positions = g[g["kind"] == "position"].sort_values("needle")
        edges = np.linspace(0, t, len(positions) + 1).round().astype(int)
        total = float((positions["kept"].to_numpy() * np.diff(edges)).sum())
        # every KV head of every compressed layer keeps n_kept of the t entries
        assert total == pytest.approx(kv.n_kept(t, ratio), abs=1e-3), (item, setting, method)
        needles = g[g["kind"] == "needle"]
        assert len(needles) == 4 and needles["asked"].all()  # multi-value: all four asked
        assert ((needles["whole"] <= needles["kept"] + 1e-9) & (needles["kept"] <= 1)).all()
        if method == "streaming_llm":  # the recent window: the last twentieth kept whole
            assert positions["kept"].iloc[-1] == 1.0
