"""Paired statistics that decide which ranking is more faithful (method §4).

Every ranking (a measure or a baseline) of a removal sweep is scored on the same
sequences (faithfulness) or items (downstream), so rankings are compared *paired*: per
sequence s, d_s = metric(reference) − metric(other), and only the distribution of d
decides. Pure: numpy and pandas only, no model.

**Which is better.** Comprehensiveness removes the top-scored tokens: a faithful ranking
picks the tokens that matter, so a *larger* ΔNLL is better. Sufficiency keeps the top
tokens: a *smaller* ΔNLL is better (:data:`HIGHER_IS_BETTER`). Downstream: a higher
accuracy is better; for the share of answers changed from clean, fewer is better.

**Faithfulness test** (:func:`paired_differences`). Per (mode, rate, pair): n, the mean
of d, its standard error (sample s.d. / √n), a 95% percentile-bootstrap interval of the
mean (:data:`RESAMPLES` resamples of the sequences with replacement, seed :data:`SEED`,
the same resampled indices for every pair of the same n) and ``p``, the two-sided paired
t-test (t = mean / s.e., n − 1 degrees of freedom). p is Holm-corrected over every row
of one table: all rates × pairs of one (metric, mode). **Verdict**: "tie" unless
p_holm < :data:`ALPHA` *and* the 95% bootstrap interval excludes 0; then "reference
better" or "other better" by the sign of the mean and the mode's direction. The two
guard each other: the t-test holds its level for small n where the percentile bootstrap
is liberal (at n = 8 it rejects where the t-test does not), and the bootstrap interval
assumes no normality of d. For a metric with few distinct values per item (an accuracy of
0 or 1, or a share of a few answers) ``test="sign"`` replaces the t-test by the exact sign
test (:func:`sign_test`; McNemar's exact test for 0/1 outcomes): there many d are equal,
and where all are the t-test's s.e. is 0 and its p 0 whatever n, while the sign test
gives two items that agree p = 0.5.

**Downstream test** (:func:`mcnemar_table`). Per (rate, other) over the items: b = items
where the reference's outcome is better, c = where the other's is, the exact two-sided
McNemar p (binomial, b of b + c at 1/2), Holm over all rates × others of one outcome,
verdict "tie" unless p_holm < :data:`ALPHA`.

**Random seeds** (``random:0``, ``random:1``, …) are one ranking, ``random``: per
sequence (item) the seeds' values are averaged before anything else (:func:`pool_seeds`).
For a downstream item that average is a fraction, and b, c count the items where the
reference's outcome is above, below the seeds' mean (the sign test; with one seed this is
McNemar exactly).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence

import numpy as np
import pandas as pd

REFERENCE = "ihc"
METRIC = "delta_nll"
ALPHA = 0.05
RESAMPLES = 20_000
SEED = 0
#: per mode: is a larger value of the metric (ΔNLL, ΔPPL) the more faithful?
HIGHER_IS_BETTER = {"comprehensiveness": True, "sufficiency": False, "insertion": False}
#: downstream outcomes per item, and whether more of it is better
OUTCOMES = {"correct": True, "changed": False}
RANDOM = "random"
_SEED_NAME = re.compile(r"^random:\d+$")

PAIRED_COLUMNS = [
    "metric", "mode", "rate", "reference", "other", "n", "mean", "se",
    "ci_low", "ci_high", "p", "p_holm", "verdict",
]  # fmt: skip
RANKING_COLUMNS = [
    "metric", "mode", "rate", "ranking", "n", "mean", "se", "wins", "losses", "ties",
]  # fmt: skip
MCNEMAR_COLUMNS = [
    "outcome", "rate", "reference", "other", "n", "b", "c",
    "reference_share", "other_share", "difference", "p", "p_holm", "verdict",
]  # fmt: skip
REFERENCE_BETTER, OTHER_BETTER, TIE = "reference better", "other better", "tie"


def seeds_as_random(measures: pd.Series) -> pd.Series:
    """The ranking names with every random seed's (``random:SEED``) written ``random``."""
    return measures.astype(str).str.replace(_SEED_NAME, RANDOM, regex=True)


def pool_seeds(rows: pd.DataFrame, unit: str, values: Sequence[str]) -> pd.DataFrame:
    """``rows`` with the random seeds' rows (``random:SEED``) replaced by one ranking
    ``random``: per (unit, the other keys) the mean of ``values`` over the seeds.
    Every other ranking's rows come back unchanged (only ``measure``, the keys and
    ``values`` are kept)."""
    keys = [c for c in ("mode", "rate") if c in rows]
    cols = [unit, *keys, "measure", *values]
    rows = rows[cols]
    seeds = rows["measure"].astype(str).str.match(_SEED_NAME)
    if not seeds.any():
        return rows.reset_index(drop=True)
    pooled = (
        rows[seeds]
        .assign(measure=RANDOM)
        .groupby([unit, *keys, "measure"], sort=False, as_index=False)[list(values)]
        .mean()
    )
    return pd.concat([rows[~seeds], pooled[cols]], ignore_index=True)


def holm(p: Sequence[float] | np.ndarray) -> np.ndarray:
    """Holm's step-down adjusted p-values (NaN stays NaN and is not counted in m):
    sorted ascending, p̃_(i) = max_{j ≤ i} min(1, (m − j + 1) p_(j))."""
    p = np.asarray(p, dtype=float)
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(np.isfinite(p))
    m = ok.size
    if m:
        order = ok[np.argsort(p[ok], kind="stable")]
        scaled = np.minimum(1.0, (m - np.arange(m)) * p[order])
        out[order] = np.maximum.accumulate(scaled)
    return out


def bootstrap_means(
    d: np.ndarray, resamples: int = RESAMPLES, seed: int = SEED, chunk: int = 4_000_000
) -> np.ndarray:
    """``(resamples,)`` means of ``d`` resampled with replacement (vectorised, in chunks
    of about ``chunk`` draws); the same seed gives the same indices for the same n."""
    n = d.size
    rng = np.random.default_rng(seed)
    rows = max(1, chunk // max(n, 1))
    out = np.empty(resamples)
    for start in range(0, resamples, rows):
        stop = min(resamples, start + rows)
        out[start:stop] = d[rng.integers(0, n, size=(stop - start, n))].mean(axis=1)
    return out


def bootstrap_interval(
    d: np.ndarray, resamples: int = RESAMPLES, seed: int = SEED, level: float = 0.95
) -> tuple[float, float]:
    """The percentile-bootstrap interval at ``level`` of the mean of ``d`` (NaN when
    n < 2)."""
    d = np.asarray(d, dtype=float)
    if d.size < 2:
        return math.nan, math.nan
    tail = (1 - level) / 2
    low, high = np.quantile(bootstrap_means(d, resamples, seed), [tail, 1 - tail])
    return float(low), float(high)


def t_test(d: np.ndarray) -> float:
    """Two-sided p-value of the one-sample t-test of mean(d) = 0 (the paired t-test of
    the two rankings): P(|T| ≥ |t|) for T ~ Student(n − 1), by the exact finite series
    for integer degrees of freedom (Abramowitz & Stegun 26.7.3-4). NaN when n < 2; when
    every d is equal, 1 if they are 0, else 0."""
    d = np.asarray(d, dtype=float)
    n = d.size
    if n < 2:
        return math.nan
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if sd == 0 or not math.isfinite(sd):
        return 1.0 if mean == 0 else 0.0
    return student_t_sf2(abs(mean) / (sd / math.sqrt(n)), n - 1)


def sign_test(d: np.ndarray) -> float:
    """Two-sided exact sign test of the paired differences ``d``: b = #(d > 0), c =
    #(d < 0), zeros dropped, p of b of b + c under Binomial(b + c, 1/2) (:func:`mcnemar_p`;
    NaN when n < 2, as :func:`t_test`)."""
    d = np.asarray(d, dtype=float)
    if d.size < 2:
        return math.nan
    return mcnemar_p(int((d > 0).sum()), int((d < 0).sum()))


def student_t_sf2(t: float, df: int) -> float:
    """P(|T| ≥ t) for T ~ Student(df), df a positive integer, t ≥ 0."""
    theta = math.atan(t / math.sqrt(df))
    sin, cos2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2:  # odd: A = 2/π (θ + sinθ cosθ (1 + 2/3 cos²θ + 2·4/(3·5) cos⁴θ + ...))
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for k in range(1, (df - 1) // 2):
            term *= cos2 * (2 * k) / (2 * k + 1)
            total += term
        inside = 2 / math.pi * (theta + sin * math.cos(theta) * total)
    else:  # even: A = sinθ (1 + 1/2 cos²θ + 1·3/(2·4) cos⁴θ + ...)
        term = total = 1.0
        for k in range(1, df // 2):
            term *= cos2 * (2 * k - 1) / (2 * k)
            total += term
        inside = sin * total
    return min(1.0, max(0.0, 1.0 - inside))


#: the paired tests :func:`paired_differences` can use, by name
TESTS = {"t": t_test, "sign": sign_test}


def difference_stats(
    d: np.ndarray, test: str = "t", resamples: int = RESAMPLES, seed: int = SEED
) -> tuple[int, float, float, float, float, float]:
    """Paired differences ``d`` summarised: n, mean, s.e., the bootstrap interval (low,
    high) and the test's p (:data:`TESTS`)."""
    n = d.size
    se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
    low, high = bootstrap_interval(d, resamples, seed)
    mean = float(d.mean()) if n else math.nan
    return n, mean, se, low, high, TESTS[test](d)


def verdict(mean: float, p_holm: float, excludes_zero: bool, higher_is_better: bool) -> str:
    """``reference better`` / ``other better`` where the Holm-corrected p is under
    :data:`ALPHA` and the interval excludes 0 (the side from the sign of ``mean``), else
    ``tie``."""
    if not (np.isfinite(p_holm) and p_holm < ALPHA and excludes_zero):
        return TIE
    return REFERENCE_BETTER if (mean > 0) == higher_is_better else OTHER_BETTER


def _direction(mode: str) -> bool:
    if mode not in HIGHER_IS_BETTER:
        raise ValueError(f"unknown mode {mode!r}; expected one of {sorted(HIGHER_IS_BETTER)}")
    return HIGHER_IS_BETTER[mode]


def _rankings(rows: pd.DataFrame) -> list[str]:
    """The rankings in the order they were run, the seeds as one ``random``."""
    names = (RANDOM if _SEED_NAME.match(str(m)) else str(m) for m in rows["measure"])
    return list(dict.fromkeys(names))


def paired_differences(
    per_sequence: pd.DataFrame,
    reference: str | None = REFERENCE,
    metric: str = METRIC,
    *,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    higher_is_better: bool | None = None,
    test: str = "t",
) -> pd.DataFrame:
    """Per (mode, rate) and each other ranking, the paired differences d_s =
    metric(reference) − metric(other) over the sequences both were scored on
    (:data:`PAIRED_COLUMNS`; test, interval, Holm family and verdict in the module
    docstring). ``reference=None`` compares every pair of rankings (the first in order of
    appearance is the pair's ``reference``), Holm over all of them per mode. Random seeds
    are pooled as ``random``. A ``reference`` that was not run is refused.
    ``higher_is_better`` decides the verdicts' direction for every mode (for a metric
    other than the removal modes', e.g. an accuracy); by default each mode's own
    (:data:`HIGHER_IS_BETTER`). ``test``: ``"t"`` (the paired t-test) or ``"sign"`` (the
    exact sign test, for discrete metrics; module docstring)."""
    if test not in TESTS:
        raise ValueError(f"unknown test {test!r}; choose one of {', '.join(TESTS)}")
    if per_sequence.empty:
        return pd.DataFrame(columns=PAIRED_COLUMNS)
    rows = pool_seeds(per_sequence, "seq", [metric])
    names = _rankings(per_sequence)
    if reference is not None and reference not in names:
        raise ValueError(f"reference {reference!r} was not run; rankings: {', '.join(names)}")
    if reference is None:
        pairs = list(itertools.combinations(names, 2))
    else:
        pairs = [(reference, o) for o in names if o != reference]
    out = []
    for (mode, rate), g in rows.groupby(["mode", "rate"], sort=False):
        table = g.pivot_table(index="seq", columns="measure", values=metric, aggfunc="mean")
        for ref, other in pairs:
            if ref not in table or other not in table:
                continue
            d = (table[ref] - table[other]).dropna().to_numpy(float)
            stats = difference_stats(d, test, resamples, seed)
            out.append([metric, mode, float(rate), ref, other, *stats])
    frame = pd.DataFrame(out, columns=PAIRED_COLUMNS[:-2])
    frame["p_holm"] = np.nan
    for _, idx in frame.groupby("mode", sort=False).groups.items():
        frame.loc[idx, "p_holm"] = holm(frame.loc[idx, "p"].to_numpy(float))
    frame["verdict"] = [
        verdict(
            r.mean,
            r.p_holm,
            bool(r.ci_low > 0 or r.ci_high < 0),
            _direction(r.mode) if higher_is_better is None else higher_is_better,
        )
        for r in frame.itertuples()
    ]
    return frame[PAIRED_COLUMNS]


def ranking_table(
    per_sequence: pd.DataFrame,
    metric: str = METRIC,
    *,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    pairs: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Per (mode, rate, ranking): n, the mean and standard error of ``metric`` over
    sequences, and how many other rankings it beats (``wins``), loses to (``losses``)
    and ties with (``ties``) by the verdicts of every pair (:func:`paired_differences`
    with ``reference=None``: Holm over all rates × pairs of one mode; ``pairs``, that
    table when the caller has it already). Random seeds are pooled as ``random`` (its
    mean and s.e. are over the per-sequence seed means)."""
    if per_sequence.empty:
        return pd.DataFrame(columns=RANKING_COLUMNS)
    rows = pool_seeds(per_sequence, "seq", [metric])
    if pairs is None:
        pairs = paired_differences(per_sequence, None, metric, resamples=resamples, seed=seed)
    tally: dict[tuple[str, float, str], list[int]] = {}
    for r in pairs.itertuples():
        for name, won in ((r.reference, REFERENCE_BETTER), (r.other, OTHER_BETTER)):
            tallied = tally.setdefault((str(r.mode), float(r.rate), str(name)), [0, 0, 0])
            tallied[0 if r.verdict == won else 2 if r.verdict == TIE else 1] += 1
    stats = (
        rows.groupby(["mode", "rate", "measure"], sort=False)[metric]
        .agg(n="count", mean="mean", se="sem")
        .reset_index()
        .rename(columns={"measure": "ranking"})
    )
    keys = zip(stats["mode"], stats["rate"], stats["ranking"], strict=True)
    counts = [tally.get((str(m), float(r), str(k)), [0, 0, 0]) for m, r, k in keys]
    stats[["wins", "losses", "ties"]] = np.array(counts, dtype=int).reshape(-1, 3)
    stats.insert(0, "metric", metric)
    stats["rate"] = stats["rate"].astype(float)
    order = {  # modes and rankings in the order they were run, rates ascending
        "mode": {k: i for i, k in enumerate(dict.fromkeys(rows["mode"]))},
        "ranking": {k: i for i, k in enumerate(_rankings(per_sequence))},
    }
    stats = stats.sort_values(
        ["mode", "rate", "ranking"], key=lambda c: c.map(order[c.name]) if c.name in order else c
    )
    return stats[RANKING_COLUMNS].reset_index(drop=True)


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value: b of b + c discordant items under Binomial(b + c,
    1/2), twice the smaller tail (1 when there is no discordant item)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def mcnemar_table(
    per_item: pd.DataFrame, reference: str = REFERENCE, outcome: str = "correct"
) -> pd.DataFrame:
    """Per (rate, other ranking), the reference's ``outcome`` against the other's on the
    same items (:data:`MCNEMAR_COLUMNS`): ``correct`` (accuracy; more is better) or
    ``changed`` (the answer differs from the clean one; fewer is better). b counts items
    where the reference's outcome is the better one, c where the other's is; ``p`` is the
    exact McNemar p, ``p_holm`` Holm over all rates × others, the verdict "tie" unless
    p_holm < :data:`ALPHA`. ``difference`` is reference_share − other_share. Random seeds
    are pooled as ``random`` (the module docstring says how)."""
    if outcome not in OUTCOMES:
        raise ValueError(f"unknown outcome {outcome!r}; expected one of {sorted(OUTCOMES)}")
    if per_item.empty:
        return pd.DataFrame(columns=MCNEMAR_COLUMNS)
    frame = per_item.assign(changed=(per_item["pick"] != per_item["clean_pick"]).astype(float))
    frame["correct"] = frame["correct"].astype(float)
    rows = pool_seeds(frame, "item", [outcome])
    names = _rankings(frame)
    if reference not in names:
        raise ValueError(f"reference {reference!r} was not run; rankings: {', '.join(names)}")
    more_is_better = OUTCOMES[outcome]
    out = []
    for rate, g in rows.groupby("rate", sort=False):
        table = g.pivot_table(index="item", columns="measure", values=outcome, aggfunc="mean")
        for other in (o for o in names if o != reference and o in table):
            pair = table[[reference, other]].dropna()
            delta = (pair[reference] - pair[other]).to_numpy(float)
            if not more_is_better:
                delta = -delta
            b, c = int((delta > 0).sum()), int((delta < 0).sum())
            ref_share, other_share = float(pair[reference].mean()), float(pair[other].mean())
            out.append([
                outcome, float(rate), reference, other, len(pair), b, c,
                ref_share, other_share, ref_share - other_share, mcnemar_p(b, c),
            ])  # fmt: skip
    result = pd.DataFrame(out, columns=MCNEMAR_COLUMNS[:-2])
    result["p_holm"] = holm(result["p"].to_numpy(float))
    result["verdict"] = [
        TIE if not p < ALPHA else REFERENCE_BETTER if b > c else OTHER_BETTER
        for p, b, c in zip(result["p_holm"], result["b"], result["c"], strict=True)
    ]
    return result[MCNEMAR_COLUMNS]
