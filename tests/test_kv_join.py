"""KVEvalResult.join (runs of other methods on the same items, as one result) and
KVEvalResult.versus (planned method-against-base comparisons)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pandas as pd
import pytest
from tiny_models import tiny_model

from contribution_weights.experiments.kv_eval import KVEvalOptions, KVEvalResult, kv_eval
from contribution_weights.experiments.paired import difference_stats, holm


def _passkey(
    model: Any, methods: str, seed: int = 0, ratios: tuple[float, ...] = (0, 0.25, 0.5)
) -> KVEvalResult:
    opts = KVEvalOptions(
        task="passkey", methods=methods, ratios=ratios, context_tokens=256, n=3,
        window=8, seed=seed,
    )  # fmt: skip
    return kv_eval(model, options=opts, progress=False)


def test_two_runs_join_into_one_and_planned_pairs_are_tested() -> None:
    model = tiny_model("llama")
    first, second = _passkey(model, "h2o_recent,snapkv"), _passkey(model, "h2o,snapkv")
    rows = second.per_item.copy()
    again = rows["method"] == "snapkv"
    rows.loc[again, "accuracy"] = 1 - rows.loc[again, "accuracy"]  # told apart from the first's
    second = KVEvalResult(rows, second.config, second.run_info)
    joined = first.join(second)
    assert joined.config["ruler_tasks"] == first.config["ruler_tasks"]  # not a RULER run
    assert joined.config["methods"] == ["h2o_recent", "snapkv", "h2o"]
    rows = joined.per_item
    assert (rows["method"] == "none").sum() == 3  # the uncompressed rows once
    # snapkv was in both: the first run's rows are kept, and h2o's rows are the second's
    mine = first.per_item.set_index(["item", "method", "ratio"]).sort_index()
    got = rows.set_index(["item", "method", "ratio"]).sort_index()
    pd.testing.assert_series_equal(got.loc[mine.index, "accuracy"], mine["accuracy"])
    theirs = second.per_item.query("method == 'h2o'").set_index(["item", "method", "ratio"])
    pd.testing.assert_series_equal(got.loc[theirs.index, "accuracy"], theirs["accuracy"])
    assert {"h2o", "h2o_recent", "snapkv"} <= set(joined.ranking()["method"])

    pairs = [("h2o", "h2o_recent"), ("snapkv", "h2o")]
    table = joined.versus(pairs)
    assert list(zip(table["method"], table["base"], strict=True)) == pairs * 2
    acc = rows.pivot_table(index=["ratio", "item"], columns="method", values="accuracy")
    ps = []
    for ratio, (method, base) in itertools.product([0.25, 0.5], pairs):
        d = (acc.loc[ratio, method] - acc.loc[ratio, base]).to_numpy(float)
        row = table[(table["ratio"] == ratio) & (table["method"] == method)].iloc[0]
        _, mean, _, _, _, p = difference_stats(d, "sign")
        assert row["mean"] == pytest.approx(mean) and row["p"] == pytest.approx(p)
        assert (row["better"], row["worse"], row["same"]) == (
            (d > 0).sum(), (d < 0).sum(), (d == 0).sum()
        )  # fmt: skip
        ps.append(p)
    np.testing.assert_allclose(table["p_holm"], holm(np.array(ps)))
    assert set(table["verdict"]) <= {"method better", "base better", "tie"}
    with pytest.raises(ValueError, match="not in this result: knorm"):
        joined.versus([("knorm", "h2o")])
    with pytest.raises(ValueError, match="versus_uncompressed"):
        joined.versus([("h2o", "none")])
    # a run that adds no new method changes nothing
    same = first.join(_passkey(model, "snapkv"))
    pd.testing.assert_frame_equal(same.per_item, first.per_item, check_dtype=False)
    # a method one run has at a ratio the other lacks: compared where both ran
    short = _passkey(model, "knorm", ratios=(0, 0.5))
    mixed = first.join(short).versus([("knorm", "snapkv")])
    assert list(mixed["ratio"]) == [0.5]


def test_a_join_of_different_items_is_refused() -> None:
    model = tiny_model("llama")
    first = _passkey(model, "h2o_recent")
    with pytest.raises(ValueError, match="seed"):
        first.join(_passkey(model, "h2o", seed=1))
    with pytest.raises(ValueError, match="no uncompressed rows"):
        first.join(_passkey(model, "h2o", ratios=(0.5,)))
    other = _passkey(model, "h2o")
    rows = other.per_item.copy()
    none = rows["method"] == "none"
    rows.loc[none, "accuracy"] = 1 - rows.loc[none, "accuracy"]  # as if other items
    with pytest.raises(ValueError, match="uncompressed rows differ on 3 of 3"):
        first.join(KVEvalResult(rows, other.config, other.run_info))


def _ruler(tasks: list[str], methods: list[str], n: int, accuracy: Any) -> KVEvalResult:
    """A RULER result by hand: items numbered over the tasks in turn, as a run does."""
    rows = []
    for t, task in enumerate(tasks):
        for j in range(n):
            for method, ratio in [("none", 0.0), *((m, 0.5) for m in methods)]:
                rows.append(
                    {"item": t * n + j, "task": task, "setting": "query_agnostic",
                     "method": method, "ratio": ratio, "depth": 0.5,
                     "accuracy": accuracy(task, j, method), "answers": "['1']",
                     "output": f"{task}-{j}", "first_token_kept": 1.0, "prefill_tokens": 64,
                     "prefill_s": 0.1, "compress_s": 0.01, "kept_mib": 1.0}
                )  # fmt: skip
    config = {"task": "ruler", "model": "m", "texts_sha256": "x", "context_tokens": 64,
              "seed": 0, "settings": ["query_agnostic"], "window": 8, "n": n,
              "ruler_tasks": tasks, "methods": methods, "ratios": [0.0, 0.5]}  # fmt: skip
    return KVEvalResult(pd.DataFrame(rows), config, {})


def _acc(task: str, j: int, method: str) -> float:
    return float((j + len(task) + len(method)) % 2)


def test_ruler_items_join_by_task_and_number_within_it() -> None:
    grid = _ruler(["niah_single", "niah_multikey"], ["snapkv"], 4, _acc)
    rest = _ruler(["niah_multikey"], ["h2o"], 3, _acc)  # the first 3 multi-key items only
    joined = grid.join(rest)
    assert joined.config["ruler_tasks"] == ["niah_multikey"] and joined.config["n"] == 3
    rows = joined.per_item
    assert sorted(rows["item"].unique()) == [0, 1, 2]
    for _, r in rows.iterrows():  # every row is its own item's: multi-key item r.item
        assert r["output"] == f"niah_multikey-{r['item']}"
        assert r["accuracy"] == _acc("niah_multikey", r["item"], r["method"])


def test_ruler_joins_of_two_common_tasks_chain() -> None:
    grid = _ruler(["niah_single", "niah_multikey"], ["snapkv"], 4, _acc)
    rest = _ruler(["niah_single", "niah_multikey"], ["h2o"], 3, _acc)
    third = _ruler(["niah_multikey", "niah_single"], ["knorm"], 2, _acc)  # another order
    # an empty output: "" in a run's own result, missing when read back from its CSV
    rows = grid.per_item.copy()
    rows.loc[(rows["method"] == "none") & (rows["item"] == 4), "output"] = np.nan  # key j = 0
    grid = KVEvalResult(rows, grid.config, {})

    def blank(run: KVEvalResult) -> KVEvalResult:
        rows = run.per_item.copy()
        first_key = run.config["ruler_tasks"].index("niah_multikey") * run.config["n"]
        rows.loc[(rows["method"] == "none") & (rows["item"] == first_key), "output"] = ""
        return KVEvalResult(rows, run.config, {})

    rest, third = blank(rest), blank(third)
    once = grid.join(rest, third).per_item
    assert once["item"].nunique() == 4  # 2 items of each task, numbered as one run would
    chained = grid.join(rest).join(third).per_item
    pd.testing.assert_frame_equal(once, chained)
    for _, r in once.iterrows():
        task, j = r["task"], r["item"] - 2 * ["niah_single", "niah_multikey"].index(r["task"])
        assert r["accuracy"] == _acc(task, j, r["method"])
