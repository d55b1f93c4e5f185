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

No model runs for these: the outputs are the run's; seconds for 50 items (tokenising the
haystack). ``--kept N`` then prefills the first N items again in each of
``--kept-settings`` and compresses them with every method and ratio of the run, as the run
did (the same window and seed), to see what each method keeps: per asked needle the share
of its tokens kept (mean over compressed layers and KV heads), the share of the 128 tokens
each side of it kept, and the share of (layer, head) pairs that keep every token of it;
per twentieth of the prefill the share kept (``kv-needles-TASK-kept.csv``, and with
``--kept-figure`` the profile). About 80 s an item and setting for SmolLM2 at 4,096 tokens
on one CPU thread beside other jobs.

``--table OUT.md FOLDER ...`` writes the Markdown tables of committed ``--out`` folders (one
per model, e.g. ``docs/results/kv-needles-smollm2-4096``) and stops, before any model or data
loads: per task, setting and ratio the recall of the late and of the early needles
(uncompressed, the window, contribution, the best other score, and how many methods the
window beats and loses to), the uncompressed recall by depth quarter, and where ``--kept``
ran what each method keeps of the asked needles::

    python benchmarks/kv_needles.py --table docs/results/kv-needles-4096.md \
        docs/results/kv-needles-smollm2-4096 docs/results/kv-needles-gemma3-270m-4096
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


def holds(needle: str, value: str) -> bool:
    """Whether a needle's text states ``value`` (its sentence ends " VALUE.")."""
    return needle.endswith(f" {value}.")


def needle_part(depth: Any, ratio: Any) -> Any:
    """``late`` where a needle's depth is at least the ratio (inside the recent window's
    span), else ``early``; element-wise on arrays."""
    import numpy as np

    return np.where(np.asarray(depth) >= np.asarray(ratio), "late", "early")


def regenerate(generator: Any, rows: Any, task: str, config: dict[str, Any]
               ) -> tuple[dict[int, Any], dict[int, Any]]:  # fmt: skip
    """The run's items of ``task`` generated again (their answers must equal the rows'): per
    item number, its asked needles (value, landed depth) in context order and all its values,
    and the item itself."""
    offset = list(config["ruler_tasks"]).index(task) * int(config["n"])
    items: dict[int, Any] = {}
    regenerated: dict[int, Any] = {}
    for index in sorted(set(rows["item"])):
        item = generator.item(task, int(config["seed"]), int(config["context_tokens"]),
                              int(index) - offset)  # fmt: skip
        saved = rows.loc[rows["item"] == index, "answers"].iloc[0]
        if "|".join(item.answers) != str(saved):
            raise SystemExit(f"item {index}: regenerated answers {item.answers} != {saved}")
        texts, depths = item.meta["needles"], item.meta["depths"]
        asked = sorted(
            (depths[i], a) for a in item.answers for i, t in enumerate(texts) if holds(t, a)
        )
        values = [t.rsplit(" ", 1)[1].rstrip(".") for t in texts]
        items[int(index)] = {"asked": [(a.lower(), d) for d, a in asked], "values": values}
        regenerated[int(index)] = item
    return items, regenerated


#: the RULER needle tasks, in the order the tables list them
TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")
#: model names of the result folders (``kv-needles-MODEL-CONTEXT``)
MODELS = {"smollm2": "SmolLM2", "gemma3-270m": "Gemma 3 270M"}
#: left out of "best other": no score
UNSCORED = ("random",)
SETTINGS = {"query_agnostic": "query-agnostic", "query_aware": "query-aware"}


def _csv(path: Path) -> list[dict[str, str]]:
    import csv

    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def _share(x: float) -> str:
    """Two decimals, halves rounded up as written (0.475 to 0.48, 0.385 to 0.39)."""
    from decimal import ROUND_HALF_UP, Decimal

    return str(Decimal(repr(x)).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP))


def _setting(setting: str, ratio: str) -> str:
    return f"{SETTINGS.get(setting, setting)}, {float(ratio):g}"


def _tasks(folder: Path) -> list[str]:
    """The tasks with a ``kv-needles-TASK-early-late.csv`` in ``folder``, RULER's order first."""
    found = [p.name[len("kv-needles-") : -len("-early-late.csv")]
             for p in folder.glob("kv-needles-*-early-late.csv")]  # fmt: skip
    return sorted(found, key=lambda t: (TASKS.index(t) if t in TASKS else len(TASKS), t))


def _model(folder: Path) -> str:
    match = re.fullmatch(r"kv-needles-(.+)-(\d+)", folder.name)
    if match is None:
        return folder.name
    return f"{MODELS.get(match[1], match[1])}, {int(match[2]):,} tokens"


def _part_table(folder: Path, part: str) -> list[str]:
    """One row per (task, setting, ratio): the recall of the ``part`` needles, uncompressed,
    by the window, by contribution and by the best other score; how many of the other methods
    the window beats and loses to item by item (``-early-late.csv``)."""
    others: set[str] = set()
    body = []
    for task in _tasks(folder):
        groups: dict[tuple[str, str], list[dict[str, str]]] = {}
        for row in _csv(folder / f"kv-needles-{task}-early-late.csv"):
            if row["part"] == part:
                groups.setdefault((row["setting"], row["ratio"]), []).append(row)
        for (setting, ratio), rows in groups.items():
            others |= {r["method"] for r in rows}
            recall = {r["method"]: float(r["recall"]) for r in rows}
            scored = {m: v for m, v in recall.items() if m not in UNSCORED and m != "contribution"}
            best = max(scored.values())
            names = ", ".join(f"`{m}`" for m, v in scored.items() if v == best)
            better = sum(r["verdict"] == "window better" for r in rows)
            worse = sum(r["verdict"] == "method better" for r in rows)
            contribution = recall.get("contribution")
            body.append(
                f"| `{task}` | {_setting(setting, ratio)} | {rows[0]['n']} "
                f"| {_share(float(rows[0]['recall_uncompressed']))} "
                f"| {_share(float(rows[0]['recall_window']))} "
                f"| {'–' if contribution is None else _share(contribution)} "
                f"| {_share(best)} ({names}) | {better} / {worse} |"
            )
    header = (f"| task | setting, ratio | items | uncompressed | `{WINDOW}` | `contribution` "
              f"| best other score | window better / worse (of {len(others)}) |")  # fmt: skip
    return [header, "| --- | --- |" + " ---: |" * 6, *body]


def _depth_table(folder: Path) -> list[str]:
    """The uncompressed model's recall by needle depth quarter, per task (``kv-needles-TASK.csv``;
    one row where the settings agree)."""
    body: list[str] = []
    bands: list[str] = []
    for task in _tasks(folder):
        rows = [r for r in _csv(folder / f"kv-needles-{task}.csv") if float(r["ratio"]) == 0]
        bands = [c for c in rows[0] if c not in ("setting", "ratio", "method")]
        cells = {r["setting"]: " | ".join(_share(float(r[b])) for b in bands) for r in rows}
        if len(set(cells.values())) == 1:
            cells = {" and ".join(SETTINGS.get(s, s) for s in cells): next(iter(cells.values()))}
        body += [f"| `{task}` | {SETTINGS.get(s, s)} | {c} |" for s, c in cells.items()]
    labels = []
    for band in bands:  # pandas' interval labels, "(-0.001, 0.25]"
        low, high = (max(float(x), 0.0) for x in band.strip("([]) ").split(","))
        labels.append(f"{low:g}-{high:g}")
    return ["| task | setting | " + " | ".join(labels) + " |",
            "| --- | --- |" + " ---: |" * len(labels), *body]  # fmt: skip


def _kept_table(path: Path) -> list[str]:
    """Per setting, per method and ratio, of the late and of the early asked needles: the share
    of their tokens kept, of the tokens around them, and of (layer, KV head) pairs keeping the
    whole needle (``kv-needles-TASK-kept.csv``), means over the needles."""
    sums: dict[tuple[str, str, str, str], list[float]] = {}
    items: set[str] = set()
    for row in _csv(path):
        if row["kind"] != "needle" or row["asked"] != "True":
            continue
        items.add(row["item"])
        part = "late" if float(row["depth"]) >= float(row["ratio"]) else "early"
        key = (row["setting"], row["method"], row["ratio"], part)
        total = sums.setdefault(key, [0.0, 0.0, 0.0, 0.0])
        for i, column in enumerate(("kept", "around", "whole")):
            total[i] += float(row[column])
        total[3] += 1
    ratios = sorted({k[2] for k in sums}, key=float)
    header = ["setting", "method"] + [f"{p} needles, {float(r):g}"
                                      for p in ("late", "early") for r in ratios]  # fmt: skip
    lines = [f"{len(items)} items; cells: kept / around / whole.", "",
             "| " + " | ".join(header) + " |",
             "| --- | --- |" + " ---: |" * (len(header) - 2)]  # fmt: skip
    for setting, method in dict.fromkeys((k[0], k[1]) for k in sums):
        cells = []
        for part in ("late", "early"):
            for ratio in ratios:
                summed = sums.get((setting, method, ratio, part))
                cells.append(
                    "–" if summed is None
                    else " / ".join(_share(x / summed[3]) for x in summed[:3])
                )  # fmt: skip
        lines.append(
            f"| {SETTINGS.get(setting, setting)} | `{method}` | " + " | ".join(cells) + " |"
        )
    return lines


def markdown(folders: list[Path]) -> str:
    """The Markdown tables of committed ``--out`` folders (one per model): per task, setting
    and ratio the recall of the late and of the early needles, uncompressed, by the window,
    by contribution and by the best other score, and the window's decided comparisons; the
    uncompressed recall by depth quarter; and, where ``--kept`` ran, what each method keeps."""
    lines = [
        "# kv-needles: which needles a compressed cache lets the model name",
        "",
        "Recall: the share of the asked needles named in the output, mean over the items that "
        "have one (items); a needle is *late* at ratio ρ when its depth in the haystack is at "
        f"least ρ, *early* otherwise. `{WINDOW}`: the recent window, against which every other "
        "method is tested item by item (sign test, Holm over the other methods per setting, "
        "ratio and part): window better / worse counts the methods it beats / loses to. Best "
        f"other score: the highest recall of the others but `contribution` and "
        f"{', '.join(f'`{m}`' for m in UNSCORED)}.",
    ]
    for folder in folders:
        model = _model(folder)
        for part in ("late", "early"):
            lines += [
                "",
                f"## {model}: recall of the {part} needles",
                "",
                *_part_table(folder, part),
            ]
        lines += ["", f"## {model}: uncompressed recall by needle depth", "", *_depth_table(folder)]
        for task in _tasks(folder):
            kept = folder / f"kv-needles-{task}-kept.csv"
            if kept.exists():
                lines += [
                    "",
                    f"## {model}, `{task}`: what each method keeps of the asked needles",
                    "",
                    "kept: the share of a needle's tokens kept (mean over the compressed layers "
                    f"and KV heads); around: of the {AROUND} tokens each side of it; whole: the "
                    "share of (layer, KV head) pairs that keep every token of it.",
                    "",
                    *_kept_table(kept),
                ]
    return "\n".join(lines) + "\n"


def write_table(out: Path, folders: list[Path]) -> int:
    """``--table OUT.md FOLDER ...``: the Markdown tables of committed ``--out`` folders."""
    out.write_text(markdown(folders))
    print(f"wrote {out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--table", nargs="+", type=Path, metavar=("OUT.md", "FOLDER"),
        help="write the Markdown tables of these --out folders (one per model) and stop",
    )  # fmt: skip
    p.add_argument("--run", type=Path, default=None, help="a kv-eval --task ruler folder")
    p.add_argument("--task", default="niah_multivalue", help="one of the run's ruler tasks")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument("--figure", type=Path, default=None, help="write the recall figure here")
    p.add_argument("--kept", type=int, default=0,
                   help="also prefill and compress the first N items again: what each method "
                        "keeps of the needles and of each part of the context")  # fmt: skip
    p.add_argument("--kept-settings", default="query_agnostic",
                   help="the settings --kept runs (comma-separated)")  # fmt: skip
    p.add_argument("--kept-figure", type=Path, default=None,
                   help="write the figure of what each method keeps (with --kept)")  # fmt: skip
    args = p.parse_args()
    if args.table:
        if len(args.table) < 2:
            p.error("--table takes OUT.md and at least one FOLDER")
        return write_table(args.table[0], args.table[1:])
    if args.run is None:
        p.error("--run is required (or --table OUT.md FOLDER ...)")

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
    items, regenerated = regenerate(generator, rows, args.task, config)

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
        g = g.assign(part=needle_part(g["depth"], ratio))
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
    if args.kept > 0:
        kept_part(
            args,
            model,
            generator,
            [regenerated[i] for i in sorted(regenerated)[: args.kept]],
            config,
        )
    return 0


#: context position bins of the kept-share profile
POSITION_BINS = 20
#: tokens each side of a needle whose kept share it is set against
AROUND = 128


def kept_rows(model: Any, generator: Any, item: Any, config: dict[str, Any], setting: str,
              index: int) -> list[dict[str, Any]]:  # fmt: skip
    """One item prefilled in ``setting`` and compressed by each of the run's methods at each
    ratio: the share of each needle's tokens kept (over compressed layers and KV heads), of
    the :data:`AROUND` tokens each side of it, the share of (layer, head) pairs that keep
    the whole needle, and the share kept of each twentieth of the prefill."""
    import numpy as np
    import torch

    from contribution_weights.kv.cache import compress
    from contribution_weights.kv.scoring import prefill

    ids = item.prefill_ids(setting)
    pre = prefill(model, ids, int(config["window"]), seed=int(config["seed"]),
                  methods=config["methods"])  # fmt: skip
    t = int(ids.shape[1])
    context = item.context[0].tolist()
    spans = []
    for text, depth in zip(item.meta["needles"], item.meta["depths"], strict=True):
        needle = generator.needle(text)
        start = next(
            i for i in range(len(context) - len(needle) + 1)
            if context[i : i + len(needle)] == needle
        )  # fmt: skip
        asked = any(holds(text, a) for a in item.answers)
        spans.append((start, start + len(needle), depth, asked))
    edges = np.linspace(0, t, POSITION_BINS + 1).round().astype(int)
    out: list[dict[str, Any]] = []
    for method in config["methods"]:
        for ratio in (r for r in config["ratios"] if r > 0):
            cache = compress(pre, method, ratio)
            share = torch.zeros(t)
            whole = torch.zeros(len(spans))
            for keep in cache.kept.values():
                keep = keep[0]  # (G, S), -1 where a head keeps fewer
                mask = torch.zeros(keep.shape[0], t + 1)
                mask.scatter_(1, torch.where(keep >= 0, keep, t), 1.0)
                share += mask[:, :t].mean(0)
                for k, (lo, hi, _, _) in enumerate(spans):
                    whole[k] += mask[:, lo:hi].min(1).values.mean()
            share /= len(cache.kept)
            whole /= len(cache.kept)
            base = {"item": index, "setting": setting, "method": method, "ratio": ratio}
            for k, (lo, hi, depth, asked) in enumerate(spans):
                around = torch.cat([share[max(lo - AROUND, 0) : lo], share[hi : hi + AROUND]])
                out.append({**base, "kind": "needle", "needle": k, "depth": depth,
                            "asked": asked, "kept": float(share[lo:hi].mean()),
                            "around": float(around.mean()), "whole": float(whole[k])})  # fmt: skip
            for b in range(POSITION_BINS):
                lo, hi = int(edges[b]), int(edges[b + 1])
                out.append({**base, "kind": "position", "needle": b, "depth": (lo + hi) / 2 / t,
                            "asked": False, "kept": float(share[lo:hi].mean())})  # fmt: skip
    return out


def kept_part(args: Any, model: Any, generator: Any, items: list[Any], config: dict[str, Any]
              ) -> None:  # fmt: skip
    """``--kept``: what each method keeps of the asked needles (late / early as above) and of
    each part of the prefill; ``kv-needles-TASK-kept.csv`` and the figure."""
    import pandas as pd
    from tqdm.auto import tqdm

    settings = args.kept_settings.split(",")
    rows = []
    for item in tqdm(items, desc="kept sets", unit="item"):
        for setting in settings:
            rows += kept_rows(model, generator, item, config, setting, item.meta["index"])
    frame = pd.DataFrame(rows)
    path = args.out / f"kv-needles-{args.task}-kept.csv"
    frame.to_csv(path, index=False)
    needles = frame[(frame["kind"] == "needle") & frame["asked"]].copy()
    needles["part"] = needle_part(needles["depth"], needles["ratio"])
    columns = ["kept", "around", "whole"]
    table = needles.groupby(["setting", "ratio", "part", "method"], sort=False)[columns].mean()
    print(f"\nthe asked needles ({len(items)} items; means over compressed layers and KV "
          "heads): kept, the share of their tokens kept; around, of the "
          f"{AROUND} tokens each side; whole, the share of (layer, head) pairs that keep "
          "every token of the needle")  # fmt: skip
    table = table.unstack("part")
    print(table.round(3).to_string())
    print(f"wrote {path}")
    if args.kept_figure is not None:
        kept_figure(frame, args.task, len(items), args.kept_figure)
        print(f"wrote {args.kept_figure}")


def kept_figure(frame: Any, task: str, n: int, path: Path) -> None:
    """Share kept by position in the prefill, one panel per (setting, ratio), the asked
    needles marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(frame["setting"]))
    ratios = sorted(set(frame["ratio"]))
    size = (4.2 * len(ratios), 3.3 * len(settings))
    fig, axes = plt.subplots(len(settings), len(ratios), figsize=size, sharey=True, squeeze=False)
    shown = ["contribution", "snapkv", "tova", "criticalkv", WINDOW]
    for i, setting in enumerate(settings):
        here = frame[frame["setting"] == setting]
        positions = here[here["kind"] == "position"]
        needles = here[(here["kind"] == "needle") & here["asked"]]
        for j, ratio in enumerate(ratios):
            ax = axes[i][j]
            for method in shown:
                g = positions[(positions["method"] == method) & (positions["ratio"] == ratio)]
                curve = g.groupby("needle")[["depth", "kept"]].mean()  # per twentieth
                style = {"lw": 2.2} if method == WINDOW else {"lw": 1.2, "alpha": 0.85}
                line = ax.plot(curve["depth"], curve["kept"], label=method, **style)[0]
                h = needles[(needles["method"] == method) & (needles["ratio"] == ratio)]
                ax.scatter(h["depth"], h["kept"], s=8, color=line.get_color(), alpha=0.5)
            ax.axhline(1 - ratio, color="grey", ls=":", lw=1)
            ax.set_title(f"{setting}, ratio {ratio:g}", fontsize=9)
            ax.set_xlabel("position in the prefill (dots: needles, by depth)")
            if j == 0:
                ax.set_ylabel("share kept (layers × KV heads)")
    axes[0][-1].legend(fontsize=7)
    title = (f"{task}, {n} items: share of the cache kept by position (lines: twentieths of "
             "the prefill; dots: asked needles; dotted: the budget)")  # fmt: skip
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


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
