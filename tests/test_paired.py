"""Paired statistics that decide (experiments/paired.py): known answers on synthetic rows."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from contribution_weights.experiments.paired import (
    MCNEMAR_COLUMNS,
    PAIRED_COLUMNS,
    RANKING_COLUMNS,
    bootstrap_interval,
    holm,
    mcnemar_p,
    mcnemar_table,
    paired_differences,
    ranking_table,
    sign_test,
    student_t_sf2,
    t_test,
)


def _rows(values: dict[str, np.ndarray], mode: str = "comprehensiveness", rate: float = 0.1):
    """per_sequence-like rows: one per (sequence, ranking) with ΔNLL ``values[ranking][s]``."""
    return pd.DataFrame(
        [
            {"seq": s, "measure": m, "mode": mode, "rate": rate, "delta_nll": float(v[s])}
            for m, v in values.items()
            for s in range(len(v))
        ]
    )


def test_a_constant_lead_decides_and_its_sign_depends_on_the_mode():
    rng = np.random.default_rng(1)
    base = rng.normal(2.0, 0.5, 40)  # sequences differ a lot; the pairing removes that
    a = base + 0.1 + rng.normal(0, 0.01, 40)
    values = {"ihc": a, "vw": base}
    comp = paired_differences(_rows(values, "comprehensiveness"))
    suff = paired_differences(_rows(values, "sufficiency"))
    assert list(comp.columns) == PAIRED_COLUMNS
    row = comp.iloc[0]
    assert (row.reference, row.other, row.n) == ("ihc", "vw", 40)
    assert row["mean"] == pytest.approx(float((a - base).mean()))
    assert row.se == pytest.approx(float((a - base).std(ddof=1) / math.sqrt(40)))
    assert row.ci_low < row["mean"] < row.ci_high and row.ci_low > 0.09
    assert row.p < 0.001 and row.verdict == "reference better"  # larger ΔNLL: removes more
    assert suff.iloc[0].verdict == "other better"  # sufficiency: a larger ΔNLL is worse


def test_equal_distributions_are_a_tie():
    rng = np.random.default_rng(2)
    values = {"ihc": rng.normal(1, 0.3, 40), "vw": rng.normal(1, 0.3, 40)}
    row = paired_differences(_rows(values)).iloc[0]
    assert row.ci_low < 0 < row.ci_high and row.p > 0.05 and row.verdict == "tie"
    identical = paired_differences(_rows({"ihc": values["vw"], "vw": values["vw"]})).iloc[0]
    assert identical.p == 1.0 and identical.verdict == "tie"


def test_bootstrap_interval_is_reproducible_and_the_t_test_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(3)
    for n in (2, 3, 8, 9, 32, 201):
        d = rng.normal(0.1, 0.5, n)
        assert bootstrap_interval(d) == bootstrap_interval(d)  # fixed seed
        assert t_test(d) == pytest.approx(stats.ttest_1samp(d, 0).pvalue, rel=1e-9, abs=1e-14)
    for df in (1, 2, 5, 30):
        for t in (0.0, 1.0, 2.5, 10.0):
            assert student_t_sf2(t, df) == pytest.approx(2 * stats.t.sf(t, df), abs=1e-13)
    assert all(math.isnan(x) for x in (*bootstrap_interval(np.array([1.0])), t_test([1.0])))
    assert t_test(np.zeros(5)) == 1.0 and t_test(np.full(5, 0.2)) == 0.0


def test_a_small_sample_needs_both_the_t_test_and_the_interval():
    # n = 8: the percentile bootstrap excludes 0 (liberal), the t-test (7 df) does not reject
    d = np.array([0.9, -0.45, 0.6, 0.25, 0.8, -0.3, 0.7, 0.3])
    assert bootstrap_interval(d)[0] > 0 and t_test(d) > 0.05
    base = np.linspace(1, 2, 8)
    row = paired_differences(_rows({"ihc": base + d, "vw": base})).iloc[0]
    assert row.verdict == "tie"


def test_holm_matches_a_hand_computation():
    p = [0.01, 0.04, 0.03, 0.005, float("nan")]
    # sorted: 0.005*4 = 0.02, 0.01*3 = 0.03, 0.03*2 = 0.06, 0.04*1 = 0.04 -> max so far 0.06
    expected = [0.03, 0.06, 0.06, 0.02, float("nan")]
    np.testing.assert_allclose(holm(p), expected)
    np.testing.assert_allclose(holm([0.5, 0.9]), [1.0, 1.0])


def test_holm_runs_over_every_rate_and_other_of_one_mode():
    rng = np.random.default_rng(4)
    frames = []
    for mode in ("comprehensiveness", "sufficiency"):
        for rate in (0.1, 0.5):
            base = rng.normal(2, 0.5, 20)
            values = {"ihc": base + rng.normal(0.02, 0.05, 20), "vw": base, "attention": base}
            frames.append(_rows(values, mode, rate))
    table = paired_differences(pd.concat(frames, ignore_index=True))
    assert len(table) == 8
    for _, g in table.groupby("mode"):
        np.testing.assert_allclose(g.p_holm, holm(g.p.to_numpy()))
        assert len(g) == 4  # 2 rates x 2 others: the family


def test_random_seeds_are_pooled_into_one_ranking():
    rng = np.random.default_rng(5)
    base = rng.normal(2, 0.5, 12)
    seeds = {f"random:{k}": base + rng.normal(0, 0.1, 12) for k in range(3)}
    rows = _rows({"ihc": base + 0.3, **seeds, "recency": base - 0.1})
    table = paired_differences(rows)
    assert table.other.tolist() == ["random", "recency"]
    mean_seeds = np.mean(list(seeds.values()), axis=0)
    assert table.iloc[0]["mean"] == pytest.approx(float((base + 0.3 - mean_seeds).mean()))
    assert (table.n == 12).all()
    with pytest.raises(ValueError, match="was not run"):
        paired_differences(rows, reference="vw")


def test_rankings_count_wins_losses_and_ties():
    rng = np.random.default_rng(6)
    base = rng.normal(2, 0.5, 40)
    values = {
        "ihc": base + 0.5 + rng.normal(0, 0.02, 40),
        "vw": base + 0.2 + rng.normal(0, 0.02, 40),
        "attention": base + rng.normal(0, 0.02, 40),
        "recency": base + rng.normal(0, 0.02, 40),
    }
    table = ranking_table(_rows(values))
    assert list(table.columns) == RANKING_COLUMNS
    by = table.set_index("ranking")
    assert by.loc["ihc", ["wins", "losses", "ties"]].tolist() == [3, 0, 0]
    assert by.loc["vw", ["wins", "losses", "ties"]].tolist() == [2, 1, 0]
    assert by.loc["attention", ["wins", "losses", "ties"]].tolist() == [0, 2, 1]
    assert by.loc["recency", ["wins", "losses", "ties"]].tolist() == [0, 2, 1]
    assert by.loc["ihc", "n"] == 40 and by.loc["ihc", "mean"] == pytest.approx(values["ihc"].mean())
    assert by.loc["ihc", "se"] == pytest.approx(values["ihc"].std(ddof=1) / math.sqrt(40))
    suff = ranking_table(_rows(values, "sufficiency")).set_index("ranking")
    assert suff.loc["ihc", ["wins", "losses"]].tolist() == [0, 3]  # smaller is better there


def test_mcnemar_exact_p_against_scipy_and_by_hand():
    stats = pytest.importorskip("scipy.stats")
    for b, c in [(0, 0), (3, 7), (10, 2), (0, 6), (25, 40)]:
        expected = 1.0 if b + c == 0 else stats.binomtest(b, b + c, 0.5).pvalue
        assert mcnemar_p(b, c) == pytest.approx(expected)
    assert mcnemar_p(0, 6) == pytest.approx(2 / 64)


def test_the_sign_test_decides_discrete_metrics_without_the_t_tests_zero_variance():
    """Two items on which a method finds the needle and the other does not: every d is 1,
    so the t-test's s.e. is 0 and its p 0, a "win" from two items; the exact sign test
    gives p = 0.5 and a tie. At n = 40 with 12 wins and 1 loss it decides (McNemar)."""
    d = np.array([1.0, 1.0])
    assert t_test(d) == 0.0 and sign_test(d) == pytest.approx(0.5)
    assert sign_test(np.array([1.0, 0.0, -1.0, 0.0])) == 1.0  # zeros dropped: 1 against 1
    assert math.isnan(sign_test(np.array([1.0])))
    two = {"good": np.array([1.0, 1.0]), "bad": np.array([0.0, 0.0])}
    t_rows = paired_differences(_rows(two), "good", higher_is_better=True).iloc[0]
    sign = paired_differences(_rows(two), "good", higher_is_better=True, test="sign").iloc[0]
    assert t_rows.verdict == "reference better" and sign.verdict == "tie"
    many = {
        "good": np.r_[np.ones(12), 0.0, np.ones(7)],
        "bad": np.r_[np.zeros(12), 1.0, np.ones(7)],
    }
    row = paired_differences(_rows(many), "good", higher_is_better=True, test="sign").iloc[0]
    assert row.p == pytest.approx(mcnemar_p(12, 1)) and row.verdict == "reference better"
    with pytest.raises(ValueError, match="unknown test"):
        paired_differences(_rows(two), "good", test="wilcoxon")


def _items(ref_ok, other_ok, other="vw", clean_ok=None):
    rows = []
    clean_ok = ref_ok if clean_ok is None else clean_ok
    for name, ok in (("ihc", ref_ok), (other, other_ok)):
        for i, (k, c) in enumerate(zip(ok, clean_ok, strict=True)):
            rows.append({"item": i, "measure": name, "rate": 0.5, "answer": 0, "pick": 1 - k,
                         "correct": k, "clean_pick": 1 - c, "clean_correct": c})  # fmt: skip
    return pd.DataFrame(rows)


def test_mcnemar_table_counts_discordant_items_and_decides():
    # 12 items the reference gets right and vw wrong, 1 the other way, 7 agree
    ref = [1] * 12 + [0] + [1] * 4 + [0] * 3
    other = [0] * 12 + [1] + [1] * 4 + [0] * 3
    table = mcnemar_table(_items(ref, other))
    assert list(table.columns) == MCNEMAR_COLUMNS
    row = table.iloc[0]
    assert (row.n, row.b, row.c) == (20, 12, 1)
    assert row.p == pytest.approx(mcnemar_p(12, 1)) and row.p_holm == pytest.approx(row.p)
    assert row.difference == pytest.approx(16 / 20 - 5 / 20)
    assert row.verdict == "reference better"
    tie = mcnemar_table(_items([1, 0, 1, 0] * 5, [0, 1, 1, 0] * 5)).iloc[0]
    assert (tie.b, tie.c, tie.verdict) == (5, 5, "tie")
    # changed answers: fewer is better; the reference keeps every clean answer here
    changed = mcnemar_table(_items(ref, other), outcome="changed").iloc[0]
    assert (changed.b, changed.c) == (13, 0) and changed.verdict == "reference better"
    assert changed.reference_share == 0.0 and changed.other_share == pytest.approx(13 / 20)


def test_mcnemar_pools_random_seeds_as_a_sign_test():
    ref = [1] * 10
    frames = [_items(ref, [0] * 10, other=f"random:{k}") for k in range(3)]
    frame = pd.concat(frames).drop_duplicates(["item", "measure"]).reset_index(drop=True)
    # seed 0 wrong on items 0-9, seeds 1, 2 right on items 0-4: pooled mean 2/3 < 1 everywhere
    frame.loc[(frame.measure != "ihc") & (frame.measure != "random:0") & (frame.item < 5),
              "correct"] = 1  # fmt: skip
    row = mcnemar_table(frame).iloc[0]
    assert row.other == "random" and (row.b, row.c) == (10, 0)
    assert row.other_share == pytest.approx((5 * 2 / 3) / 10)


def test_results_write_their_paired_tables_beside_the_summary(tmp_path):
    from contribution_weights.experiments.downstream import DownstreamResult, per_item_frame
    from contribution_weights.experiments.faithfulness import (
        FaithfulnessResult,
        per_sequence_frame,
    )

    rng = np.random.default_rng(7)
    rows = _rows({"ihc": rng.normal(2, 0.1, 6), "random:0": rng.normal(1, 0.1, 6)})
    rows = rows.assign(n_tokens=8, nll=1.0, ppl=1.0, nll_clean=1.0, ppl_clean=1.0,
                       delta_ppl=rows.delta_nll, threshold="")  # fmt: skip
    res = FaithfulnessResult(per_sequence_frame(rows.to_dict("records")), {"model": "m"})
    folder = res.save(tmp_path / "f")
    paired = pd.read_csv(folder / "summary_paired.csv")
    assert paired.other.tolist() == ["random"] and paired.verdict.tolist() == ["reference better"]
    rankings = pd.read_csv(folder / "summary_rankings.csv")
    assert rankings.ranking.tolist() == ["ihc", "random"] and rankings.wins.tolist() == [1, 0]
    loaded = FaithfulnessResult.load(folder)
    pd.testing.assert_frame_equal(loaded.paired(), res.paired())

    items = _items([1] * 8, [0] * 8)
    items["n_prompt_tokens"], items["n_options"] = 5, 2
    down = DownstreamResult(per_item_frame(items.to_dict("records")), {"task": "toy"})
    table = pd.read_csv(down.save(tmp_path / "d") / "summary_paired.csv")
    assert table.task.unique().tolist() == ["toy"]
    assert table.outcome.tolist() == ["correct", "changed"] and (table.b == 8).all()
    # no reference run: no paired file (the rankings still are)
    res = FaithfulnessResult(res.rows[res.rows.measure != "ihc"], {"model": "m"})
    assert not (res.save(tmp_path / "g") / "summary_paired.csv").exists()


PUBLISHED = sorted(
    p.parent
    for pattern in ("faithfulness-*/summary_paired.csv", "downstream-*/summary_paired.csv")
    for p in (Path(__file__).parents[1] / "docs" / "results").glob(pattern)
)


@pytest.mark.parametrize("folder", PUBLISHED, ids=lambda p: p.name)
def test_published_folders_give_back_their_paired_tables(folder):
    from contribution_weights.experiments.downstream import DownstreamResult
    from contribution_weights.experiments.faithfulness import FaithfulnessResult

    if folder.name.startswith("faithfulness"):
        res = FaithfulnessResult.load(folder)
        tables = {"summary_paired.csv": res.paired(), "summary_rankings.csv": res.rankings()}
    else:
        tables = {"summary_paired.csv": DownstreamResult.load(folder).paired()}
    for name, table in tables.items():
        published = pd.read_csv(folder / name)
        pd.testing.assert_frame_equal(table, published, check_dtype=False, atol=1e-12)
