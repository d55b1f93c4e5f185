"""What the sign of a method's scores does to the deletion curves: signed against |scores|.

``python benchmarks/attribution_sign.py --run docs/results/attribution-smollm2-deletion-64``
``python benchmarks/attribution_sign.py --run docs/results/attribution-smollm2-induction-64
--method direct``

Rescores the items of a finished ``cw attribution-eval`` run (a deletion run, or a
known-answer run: its items are generated again from its config) with ``--method`` (flow
by default; the run must hold its curves, in ``rows.csv`` or ``added-METHOD.csv``), ranks
them by the scores' absolute value (``|method|``) and runs the same deletion and insertion
edits as the run. Prints, per item group (most candidates' scores negative or not), the
answer's log-probability and where the five latest candidates sit in the method's order,
the share of negative scores among the candidates the signed order ranks lowest (those
sufficiency removes first), then the paired differences method − |method|, |method| −
recency and |method| − random (seeds pooled) of the mean ``delta`` over the rates (paired
t-tests, Holm over the eighteen). Where the run holds the curves of ``METHOD_abs`` (added
with ``--add-methods``: the same |method| order), they are read from it instead of edited
again (``--recompute`` edits them anyway). Writes ``attribution-sign[-METHOD].csv`` (the
per-item statistics and the |method| curve rows), ``.json`` (the groups and the tests) and
``.md`` (their tables) under ``--out``; ``--table RESULT.json`` writes the ``.md`` again.
About 20 s an item on one CPU thread for SmolLM2 at 128 tokens when it edits, about a
second an item when it reads the run's curves. The data directory is read from
``CW_DATA_DIR`` (or ``--data-dir``), as ``cw attribution-eval`` reads it.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def markdown(result: dict) -> str:
    """The tables of a result: the item groups by the sign of their scores, then the paired
    tests (Holm over all of them)."""
    method, g = result["method"], result["groups"]
    lines = [
        f"`{result['run']}`, {result['items']} items, |{method}| curves "
        f"{'read from the run' if result['curves'] == 'run' else 'edited again'}",
        "",
        f"| items | n | mean log P of the answer | five latest candidates' percentile in "
        f"{method}'s order |",
        "| --- | ---: | ---: | ---: |",
    ]
    for key, label in (("negative", f"most {method} scores negative"), ("other", "the others")):
        row = g[key]
        lines.append(
            f"| {label} | {row['n']} | {row['mean_logp']:.2f} | {row['last5_percentile']:.3f} |"
        )
    lines += [
        "",
        f"Spearman (share of negative scores, log P) {g['spearman']:.2f}; share of negative scores "
        f"among the lowest 10% of the signed order {g['lowest10_negative_share']:.3f}.",
        "",
        "| intervention | mode | difference | mean ± s.e. (nats) | p | p (Holm) |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for test in result["tests"]:
        bold = "**" if test["p_holm"] < 0.05 else ""
        pair = test["pair"].replace("|", "\\|")
        lines.append(
            f"| {test['intervention']} | {test['mode']} | {pair} | "
            f"{bold}{test['mean']:+.2f} ± {test['se']:.2f}{bold} | {test['p']:.2g} | "
            f"{test['p_holm']:.2g} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", type=Path, default=None, metavar="RESULT.json",
                   help="write the .md of this result beside it and stop")  # fmt: skip
    p.add_argument("--recompute", action="store_true",
                   help="edit the |method| curves even where the run holds them")  # fmt: skip
    p.add_argument("--run", type=Path, default=None, help="a finished attribution-eval run")
    p.add_argument("--method", default="flow", help="a method whose curves the run holds")
    p.add_argument("--dataset", default="fineweb-edu", help="the run's --dataset")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--limit", type=int, default=None, help="only the first N items (a check)")
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    args = p.parse_args()
    if args.table is not None:
        args.table.with_suffix(".md").write_text(markdown(json.loads(args.table.read_text())))
        return 0
    if args.run is None:
        p.error("--run is required (or --table RESULT.json)")

    import numpy as np
    import pandas as pd
    import torch
    from scipy import stats

    import contribution_weights as cw
    from contribution_weights.attribution.run import method_function
    from contribution_weights.attribution.targets import Target
    from contribution_weights.data import load_texts
    from contribution_weights.experiments.attribution_eval import (
        AttributionEval,
        AttributionEvalOptions,
        ranking_order,
        removal_sets,
    )
    from contribution_weights.experiments.paired import holm, seeds_as_random

    method = args.method
    config = json.loads((args.run / "config.json").read_text())
    if config.get("experiment") != "attribution-eval":
        raise SystemExit(f"{args.run} is not a run of cw attribution-eval")
    deletion = config["task"] == "deletion"
    rows = pd.read_csv(args.run / "rows.csv")
    for name in (method, f"{method}_abs"):
        added = args.run / f"added-{name}.csv"
        if added.is_file():
            rows = pd.concat([rows, pd.read_csv(added)], ignore_index=True)
    held = rows[(rows["kind"] == "curve") & (rows["measure"] == f"{method}_abs")]
    read_curves = not args.recompute and not held.empty
    if method not in set(rows["measure"]):
        raise SystemExit(f"{args.run} has no curves of {method}; add it with --add-methods")
    model = cw.load_model(config["model"])
    texts = load_texts(args.dataset, data_dir=args.data_dir) if deletion else None
    opts = AttributionEvalOptions(task=config["task"], n=config["n"], tokens=config["tokens"],
                                  seed=config["seed"], methods=[method],
                                  baselines=["recency"])  # fmt: skip
    exp = AttributionEval(model, texts, opts)
    if exp.config()["items_sha256"] != config["items_sha256"]:
        raise SystemExit(f"these inputs do not make the items of {args.run}; pass its --dataset")
    hits = rows[rows["kind"] == "hit"].drop_duplicates("item").set_index("item")
    stat_rows, curve_rows = [], []
    items = exp.items[: args.limit]
    for i, item in enumerate(items):
        ids = torch.tensor(item.ids)
        target = Target(item.position, item.answer, "logprob")
        out = method_function(method)(model, ids, [target], exp.attribute_options)
        signed = out.scores[0].detach().double().cpu()
        scores = {method: signed, "abs": signed.abs()}
        cand = exp._candidates(item)
        n = cand.numel()
        order = ranking_order(method, scores, cand, i, 0).tolist()
        latest = [order.index(int(q)) / (n - 1) for q in cand[-5:]]
        lowest = order[n - max(1, math.ceil(0.1 * n)) :]  # sufficiency's first 10%
        stat_rows.append({"item": i, "neg_share": float((signed[cand] < 0).double().mean()),
                          "lowest10_neg_share": float((signed[lowest] < 0).double().mean()),
                          "last5_rank_pct": float(np.mean(latest))})  # fmt: skip
        full = float(hits.loc[i, "value_full"])  # the run's unedited log-probability
        for how in () if read_curves else opts.interventions:
            sets = removal_sets(ranking_order("abs", scores, cand, i, 0), opts.rates)
            values = exp.editor.values(ids, item.answer, [s for _, _, s in sets], how)
            for (mode, rate, _), v in zip(sets, values, strict=True):
                curve_rows.append({"item": i, "intervention": how, "mode": mode,
                                   "rate": rate, "delta": full - v})  # fmt: skip
        print(f"item {i + 1}/{len(items)}", flush=True)

    st = pd.DataFrame(stat_rows).set_index("item")
    if read_curves:  # the run's own |method| curves, the items rescored here
        curve_rows = held[held["item"] < len(items)][
            ["item", "intervention", "mode", "rate", "delta"]
        ].to_dict("records")
    ab = pd.DataFrame(curve_rows)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "attribution-sign.csv" if method == "flow" else f"attribution-sign-{method}.csv"
    st.join(ab.set_index("item"), how="outer").to_csv(args.out / name)
    st = st.join(hits[["value_full"]])
    curves = rows[rows["kind"] == "curve"]
    curves = curves.assign(measure=seeds_as_random(curves["measure"]))
    per = curves.groupby(["measure", "intervention", "mode", "item"])["delta"].mean()
    mine = ab.groupby(["intervention", "mode", "item"])["delta"].mean()
    neg = st["neg_share"] > 0.5
    rho = st["neg_share"].corr(st["value_full"], method="spearman")
    print(f"{int(neg.sum())} of {len(st)} items with most {method} scores negative; mean log "
          f"P {st['value_full'][neg].mean():.2f} against {st['value_full'][~neg].mean():.2f}; "
          f"Spearman(share negative, log P) {rho:.2f}; five latest candidates at percentile "
          f"{st['last5_rank_pct'][neg].mean():.3f} against "
          f"{st['last5_rank_pct'][~neg].mean():.3f}; the lowest 10% of the signed order "
          f"{st['lowest10_neg_share'].mean():.3f} negative")  # fmt: skip
    tests = []
    for how in opts.interventions:
        for mode in ("comprehensiveness", "sufficiency", "insertion"):
            f = per.loc[(method, how, mode)].reindex(st.index).to_numpy()
            a = mine.loc[(how, mode)].reindex(st.index).to_numpy()
            pairs = [(f"{method} - |{method}|", f - a)]
            for base in ("recency", "random"):
                if (base, how, mode) in per.index:
                    b = per.loc[(base, how, mode)].reindex(st.index).to_numpy()
                    pairs.append((f"|{method}| - {base}", a - b))
            for label, d in pairs:
                se = d.std(ddof=1) / math.sqrt(d.size)
                tests.append((how, mode, label, d.mean(), se, stats.ttest_1samp(d, 0).pvalue))
    result = {
        "run": args.run.name,
        "method": method,
        "items": len(st),
        "curves": "run" if read_curves else "edited",
        "groups": {
            "negative": {
                "n": int(neg.sum()),
                "mean_logp": float(st["value_full"][neg].mean()),
                "last5_percentile": float(st["last5_rank_pct"][neg].mean()),
            },
            "other": {
                "n": int((~neg).sum()),
                "mean_logp": float(st["value_full"][~neg].mean()),
                "last5_percentile": float(st["last5_rank_pct"][~neg].mean()),
            },
            "spearman": float(rho),
            "lowest10_negative_share": float(st["lowest10_neg_share"].mean()),
        },
        "tests": [],
    }
    for (how, mode, label, m, se, pv), ph in zip(tests, holm([t[-1] for t in tests]), strict=True):
        print(f"{how:9s} {mode:17s} {label:22s} {m:+.2f} ± {se:.2f}  p_holm {ph:.2g}")
        result["tests"].append({"intervention": how, "mode": mode, "pair": label, "mean": float(m),
                                "se": float(se), "p": float(pv), "p_holm": float(ph)})  # fmt: skip
    stem = (args.out / name).with_suffix("")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
