"""Which needles a compressed cache still lets the model name, by where they sit.

``python benchmarks/kv_needles.py --run docs/results/kv-ruler-smollm2-4096-mv-mq
--task niah_multivalue --figure docs/figures/kv-needles-smollm2-4096-niah_multivalue.png``

Reads a ``cw kv-eval --task ruler`` run folder, generates the items of one needle task
(``niah_single``, ``niah_multikey``, ``niah_multivalue``, ``niah_multiquery``) again from the run's
config (the model's tokenizer and the haystack texts: ``$CW_DATA_DIR`` or ``--data-dir``;
the regenerated answers must equal the run's) and splits each row's accuracy over the
asked needles: was needle k (k-th in the context, at its landed depth) named in the
output? Prints and writes (``kv-needles-TASK.csv`` under ``--out``):

* recall per (setting, ratio, method) and needle depth band (0-0.25, 0.25-0.5, 0.5-0.75,
  0.75-1 of the haystack);
* the ``early`` / ``late`` split at each ratio: a needle is late when its depth is at least
  the ratio (the tokens StreamingLLM's recent window keeps at that ratio lie after that
  depth, up to its four sinks), and per item the recall of its late needles and of its
  early ones; every method against ``streaming_llm`` on the same items (method −
  StreamingLLM, bootstrap interval, sign test, Holm over the methods per setting, ratio
  and part), beside the uncompressed cache's recall of the same needles;
* invented numbers: seven-digit numbers in the output that are none of the item's
  values, and those of them one or two digits from a value (a needle read with digits
  lost), per row.

No model runs: the outputs are the run's. Seconds for 50 items (tokenising the haystack).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

#: depth bands of the recall table
BANDS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: the recent window's method, the reference of the early / late tests
WINDOW = "streaming_llm"
NUMBER = re.compile(r"(?<!\d)\d{7}(?!\d)")


def digits_apart(a: str, b: str) -> int:
    """Positions where two numbers of equal length differ (else their length apart)."""
    if len(a) != len(b):
        return max(len(a), len(b))
    return sum(x != y for x, y in zip(a, b, strict=True))


def needle_rows(per_item: Any, items: dict[int, Any]) -> list[dict[str, Any]]:
    """One row per (run row, asked needle): its position and depth, found or not."""
    out = []
    for r in per_item.itertuples(index=False):
        item = items[r.item]
        text = str(r.output).lower() if isinstance(r.output, str) else ""
        for k, (value, depth) in enumerate(item["asked"]):
            out.append({"item": r.item, "setting": r.setting, "method": r.method,
                        "ratio": r.ratio, "needle": k, "depth": depth,
                        "found": float(value in text)})  # fmt: skip
    return out


def invented(per_item: Any, items: dict[int, Any]) -> list[dict[str, Any]]:
    """Per run row: seven-digit numbers named that are no value of the item, and those of
    them within two digits of one."""
    out = []
    for r in per_item.itertuples(index=False):
        values = items[r.item]["values"]
        named = set(NUMBER.findall(r.output if isinstance(r.output, str) else ""))
        wrong = named - set(values)
        near = {w for w in wrong if min(digits_apart(w, v) for v in values) <= 2}
        out.append({"item": r.item, "setting": r.setting, "method": r.method,
                    "ratio": r.ratio, "invented": len(wrong), "garbled": len(near)})  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", type=Path, required=True, help="a kv-eval --task ruler folder")
    p.add_argument("--task", default="niah_multivalue", help="one of the run's ruler tasks")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument("--figure", type=Path, default=None, help="write the recall figure here")
    args = p.parse_args()

    import numpy as np
    import pandas as pd
    from _timing import data_dir  # benchmarks/_timing.py, beside this script

    import contribution_weights as cw
    from contribution_weights.cli.experiment_cmd import HAYSTACK_TEXTS
    from contribution_weights.experiments.kv_eval import NO_COMPRESSION, KVEvalResult
    from contribution_weights.experiments.paired import difference_stats, holm, verdict
    from contribution_weights.kv.ruler import RulerGenerator
    from contribution_weights.runs import fingerprint

    config = json.loads((args.run / "config.json").read_text())
    tasks = config.get("ruler_tasks") or []
    if config.get("task") != "ruler" or args.task not in tasks:
        raise SystemExit(f"{args.run} is no kv-eval ruler run of {args.task} (its tasks: {tasks})")
    result = KVEvalResult.load(args.run)
    rows = result.per_item[result.per_item["task"] == args.task].reset_index(drop=True)
    if rows.empty:
        raise SystemExit(f"{args.run} has no complete {args.task} item yet")
    folder = args.data_dir or data_dir()  # $CW_DATA_DIR, checked
    texts = cw.data.load_texts(config["source"].split(":", 1)[1], HAYSTACK_TEXTS, folder)
    if fingerprint(texts) != config["texts_sha256"]:
        raise SystemExit("the haystack texts differ from the run's (texts_sha256)")
    model = cw.load_model(config["model"])
    generator = RulerGenerator(model.tokenizer, texts)
    offset = tasks.index(args.task) * int(config["n"])
    items: dict[int, Any] = {}
    for index in sorted(set(rows["item"])):
        item = generator.item(args.task, int(config["seed"]), int(config["context_tokens"]),
                              int(index) - offset)  # fmt: skip
        saved = rows.loc[rows["item"] == index, "answers"].iloc[0]
        if "|".join(item.answers) != str(saved):
            raise SystemExit(f"item {index}: regenerated answers {item.answers} != {saved}")
        # the asked needles in context order, with the depth each landed at
        texts_, depths = item.meta["needles"], item.meta["depths"]
        asked = sorted(
            (depths[i], a)
            for a in item.answers
            for i, t in enumerate(texts_)
            if t.endswith(f" {a}.")
        )
        values = [t.rsplit(" ", 1)[1].rstrip(".") for t in texts_]
        items[int(index)] = {"asked": [(a.lower(), d) for d, a in asked], "values": values}

    needles = pd.DataFrame(needle_rows(rows, items))
    needles["band"] = pd.cut(needles["depth"], BANDS, include_lowest=True).astype(str)
    recall = (needles.groupby(["setting", "ratio", "method", "band"], sort=False)["found"]
              .mean().unstack("band"))  # fmt: skip
    recall = recall[sorted(recall.columns, key=lambda band: float(band.split(",")[1][:-1]))]
    pd.set_option("display.width", 200)
    print(f"{args.task}: {len(items)} items, recall of the asked needles by depth band")
    print(recall.round(2).to_string())

    # early / late at each ratio, each method against the recent window, item by item
    tests = []
    compressed = needles[needles["ratio"] > 0]
    for (setting, ratio), g in compressed.groupby(["setting", "ratio"], sort=False):
        base = needles[(needles["ratio"] == 0) & (needles["setting"] == setting)]
        g = pd.concat([g, base])
        g = g.assign(part=np.where(g["depth"] >= ratio, "late", "early"))
        per = g.groupby(["part", "method", "item"])["found"].mean()
        for part in ("early", "late"):
            if part not in per.index.get_level_values(0):
                continue
            wide = per[part].unstack("method")
            for method in wide.columns.drop([WINDOW, NO_COMPRESSION], errors="ignore"):
                d = (wide[method] - wide[WINDOW]).dropna().to_numpy(float)
                n, mean, _, low, high, pv = difference_stats(d, "sign")
                tests.append({"setting": setting, "ratio": ratio, "part": part,
                              "method": method, "n": n, "recall": float(wide[method].mean()),
                              "recall_window": float(wide[WINDOW].mean()),
                              "recall_uncompressed": float(wide[NO_COMPRESSION].mean()),
                              "mean": mean, "ci_low": low, "ci_high": high, "p": pv})  # fmt: skip
    tests_frame = pd.DataFrame(tests)
    tests_frame["p_holm"] = np.nan
    for _, g in tests_frame.groupby(["setting", "ratio", "part"], sort=False):
        tests_frame.loc[g.index, "p_holm"] = holm(g["p"].to_numpy(float))
    tests_frame["verdict"] = [
        verdict(r.mean, r.p_holm, not (r.ci_low <= 0 <= r.ci_high), True)
        for r in tests_frame.itertuples()
    ]
    tests_frame["verdict"] = (
        tests_frame["verdict"]
        .map({"reference better": "method better", "other better": "window better"})
        .fillna("tie")
    )
    print("\nrecall of early / late needles (late: depth >= ratio), method − streaming_llm")
    print(tests_frame.round(3).to_string(index=False))

    made = pd.DataFrame(invented(rows, items))
    numbers = made.groupby(["setting", "ratio", "method"], sort=False)[["invented", "garbled"]]
    print("\ninvented seven-digit numbers per row (garbled: within two digits of a value)")
    print(numbers.mean().round(2).to_string())

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kv-needles-{args.task}.csv"
    recall.reset_index().to_csv(path, index=False)
    tests_frame.to_csv(args.out / f"kv-needles-{args.task}-early-late.csv", index=False)
    numbers.mean().reset_index().to_csv(args.out / f"kv-needles-{args.task}-invented.csv",
                                        index=False)  # fmt: skip
    print(f"\nwrote {path} and its -early-late.csv, -invented.csv")
    if args.figure is not None:
        figure(needles, args.task, args.figure)
        print(f"wrote {args.figure}")
    return 0


def figure(needles: Any, task: str, path: Path) -> None:
    """Recall by needle depth (five bins), one panel per (setting, ratio > 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    bins = np.linspace(0, 1, 6)
    centres = (bins[:-1] + bins[1:]) / 2
    needles = needles.assign(
        bin=np.clip(np.digitize(needles["depth"], bins) - 1, 0, len(centres) - 1)
    )
    frame = needles[needles["ratio"] > 0]
    settings = list(dict.fromkeys(frame["setting"]))
    ratios = sorted(set(frame["ratio"]))
    size = (4 * len(ratios), 3.2 * len(settings))
    fig, axes = plt.subplots(len(settings), len(ratios), figsize=size, sharey=True, squeeze=False)
    base = needles[needles["ratio"] == 0]
    shown = ["contribution", "snapkv", "tova", "criticalkv", WINDOW]
    for i, setting in enumerate(settings):
        ref = base[base["setting"] == setting].groupby("bin")["found"].mean()
        for j, ratio in enumerate(ratios):
            ax = axes[i][j]
            ax.plot(centres[ref.index], ref.to_numpy(), color="black", lw=2, label="uncompressed")
            g = frame[(frame["setting"] == setting) & (frame["ratio"] == ratio)]
            for method in shown:
                m = g[g["method"] == method].groupby("bin")["found"].mean()
                style = {"lw": 2.2} if method == WINDOW else {"lw": 1.2, "alpha": 0.85}
                ax.plot(centres[m.index], m.to_numpy(), marker="o", ms=3, label=method, **style)
            ax.axvline(ratio, color="grey", ls=":", lw=1)
            ax.set_title(f"{setting}, ratio {ratio:g}", fontsize=9)
            ax.set_xlabel("needle depth in the haystack")
            if j == 0:
                ax.set_ylabel("share of needles named")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{task}: which needles survive compression (dotted: the ratio; StreamingLLM "
                 "keeps the tokens after it)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
