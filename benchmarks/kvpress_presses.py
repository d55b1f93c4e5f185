"""Our methods as kvpress presses, checked against our own path (``cw.kv.prefill`` + ``compress``).

``contribution_weights.kv.presses`` turns every registered method into a kvpress 0.5.5
press. kvpress pins ``transformers < 5.3`` while this package needs 5.24, so, as
``kvpress_crosscheck.py``, the check runs in two environments and meets in one file::

    # 1. ours (the project's .venv): scores, kept sets and NLL of every method, and the inputs
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kvpress_presses.py ours --out presses.pt
    # 2. kvpress (.venv-kvpress): the same inputs through our presses inside kvpress's
    #    press context manager (and one run of kvpress's pipeline), compared with step 1
    OMP_NUM_THREADS=1 .venv-kvpress/bin/python benchmarks/kvpress_presses.py kvpress \\
        --ours presses.pt --report docs/results/kvpress-presses-smollm2-fineweb-edu-512.json

``make kvpress-check`` builds ``.venv-kvpress`` and runs both (not part of ``make test``).

Model: SmolLM2-135M, loaded in the kvpress environment with plain transformers from the
dequantised safetensors folder that ``cw.load_model()`` writes (its path is in the file of
step 1), float32, eager attention for the scorer presses (our side's prefill gathers every
statistic, so it computes every layer's attention eagerly too); sdpa for the head-adaptive
(``adakv_*``) presses, whose evicted entries kvpress masks in a patched attention function
that eager attention bypasses (our side prefills them on sdpa too: they read the window
alone). One attention kernel on both sides keeps the hidden states, hence the scores,
equal to the bit; across kernels a near-tie can flip.

Inputs: the first ``--n`` FineWeb-Edu LM items of ``C + 129`` tokens (as ``cw kv-eval``).
For every registered method and ratio the report gives the largest difference of the
scores (per layer and KV head, the press's ``score`` against ``score_for_budget`` on our
prefill's statistics), the share of our kept entries the press also keeps, and both NLLs of
the next 128 tokens fed on the compressed cache.

The table of a committed report (read from the JSON alone: neither kvpress nor torch is
imported, so it runs in the project's .venv)::

    .venv/bin/python benchmarks/kvpress_presses.py --table \\
        docs/results/kvpress-presses-smollm2-fineweb-edu-512.md \\
        docs/results/kvpress-presses-smollm2-fineweb-edu-512.json

``markdown(report)`` gives it: a line of what the report records (versions, C, items,
ratios), then per method (the uncompressed run first), over its items and ratios, the
attention kernel, how many kept sets are identical, the lowest kept agreement, the largest
score difference and score, and the largest |NLL ours − NLL press|; then a line on
kvpress's pipeline run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from _timing import data_dir, plain_models  # benchmarks/_timing.py, beside this script


def ours(args: argparse.Namespace) -> None:
    import torch

    import contribution_weights as cw
    from contribution_weights.kv.cache import n_kept
    from contribution_weights.kv.evaluate import lm_item, lm_items

    data_dir()  # $CW_DATA_DIR, checked
    model = cw.load_model()
    texts = cw.data.load_texts("fineweb-edu")
    methods = cw.kv.resolve_methods(args.methods)
    record: dict[str, Any] = {
        "model_dir": str(model.model.name_or_path),
        "context": args.context,
        "ratios": args.ratios,
        "methods": methods,
        "items": [],
    }
    for ids in lm_items(model, texts, args.context, args.n):
        prefix, fed = lm_item(ids, args.context)
        pre = cw.kv.prefill(model, prefix)  # every statistic: every layer eager
        # the head-adaptive methods read the window alone: that prefill runs on sdpa, as
        # kvpress's side must for them
        adaptive = [m for m in methods if cw.kv.get_method(m).head_adaptive]
        pre_sdpa = cw.kv.prefill(model, prefix, methods=adaptive) if adaptive else pre
        item: dict[str, Any] = {"ids": ids, "scores": {}, "kept": {}, "nll": {}}
        item["nll"]["none"] = _nll_after(model, cw.kv.compress(pre, "knorm", 0.0), fed)
        for method in methods:
            spec = cw.kv.get_method(method)
            prefilled = pre_sdpa if spec.head_adaptive else pre
            for ratio in args.ratios:
                item["scores"][(method, ratio)] = {
                    i: spec.score_for_budget(s, n_kept(s.length, ratio)).float()
                    for i, s in prefilled.stats.items()
                }
                small = cw.kv.compress(prefilled, method, ratio)
                item["kept"][(method, ratio)] = small.kept
                item["nll"][(method, ratio)] = _nll_after(model, small, fed)
        record["items"].append(item)
        print(f"ours: item {len(record['items'])} done", flush=True)
    torch.save(record, args.out)
    print(f"wrote {args.out} (model folder {record['model_dir']})")


def _nll_after(model: Any, small: Any, fed: Any) -> float:
    """NLL of the continuation fed on a compressed cache (float64 log-softmax on both
    sides: ``lm_score``'s float32 one differs from it by up to ~1e-5)."""
    import torch

    with torch.no_grad():
        logits = small.forward(model.model, fed[:, :-1].to(model.model.device)).logits
    return _nll(logits, fed[:, 1:])


def kvpress_side(args: argparse.Namespace) -> None:
    import kvpress
    import torch
    import transformers

    from contribution_weights.kv import get_method
    from contribution_weights.kv.presses import KVPRESS_VERSION, press

    transformers.utils.logging.disable_progress_bar()
    record = torch.load(args.ours, weights_only=False)
    models = plain_models(record["model_dir"])
    c = record["context"]
    report: dict[str, Any] = {
        "kvpress": getattr(kvpress, "__version__", KVPRESS_VERSION),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model_dir": record["model_dir"],
        "context": c,
        "n_items": len(record["items"]),
        "ratios": record["ratios"],
        "methods": record["methods"],
        "rows": [],
    }
    started = time.perf_counter()
    for n_item, item in enumerate(record["items"]):
        ids = item["ids"][None]
        prefix, fed = ids[:, :c], ids[:, c : c + 129]
        nll = _run(models["eager"], None, prefix, fed, c)
        report["rows"].append(
            {"item": n_item, "method": "none", "ratio": 0.0, "nll_ours": item["nll"]["none"],
             "nll_kvpress": nll}
        )  # fmt: skip
        for method in record["methods"]:
            adaptive = get_method(method).head_adaptive
            model = models["sdpa" if adaptive else "eager"]
            for ratio in record["ratios"]:
                p = press(method, ratio)
                scores = _record_scores(p)
                nll = _run(model, p, prefix, fed, c)
                mine = item["kept"][(method, ratio)]
                if adaptive:
                    theirs = _masked_kept(model, sorted(mine), prefix.shape[1])
                else:
                    k = max(1, int(c * (1 - ratio)))
                    theirs = {i: _mask(s.topk(k, dim=-1).indices, c) for i, s in scores.items()}
                agree = [_agreement(_mask(mine[i], c), theirs[i]) for i in sorted(mine)]
                ours_scores = item["scores"][(method, ratio)]
                diff = max(
                    float((ours_scores[i] - scores[i].float()).abs().max()) for i in sorted(mine)
                )
                report["rows"].append(
                    {
                        "item": n_item,
                        "method": method,
                        "ratio": ratio,
                        "attention": "sdpa" if adaptive else "eager",
                        "score_max_abs_diff": diff,
                        "score_max_abs": max(
                            float(s[s.isfinite()].abs().max()) for s in ours_scores.values()
                        ),
                        "kept_agreement": min(agree),
                        "nll_ours": item["nll"][(method, ratio)],
                        "nll_kvpress": nll,
                    }
                )
        print(
            f"kvpress: item {n_item + 1} done ({time.perf_counter() - started:.0f} s)", flush=True
        )
    report["pipeline"] = _pipeline_check(models["eager"], record, press)
    report["summary"] = _summary(report["rows"])
    Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
    _print_summary(report)


def _run(model: Any, p: Any, prefix: Any, fed: Any, c: int) -> float:
    """Prefill ``prefix`` (through the press ``p``, if any), then the NLL of ``fed``."""
    import contextlib

    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        with p(model) if p is not None else contextlib.nullcontext():
            model(input_ids=prefix, past_key_values=cache)
        logits = model(
            input_ids=fed[:, :-1], past_key_values=cache,
            position_ids=torch.arange(c, c + fed.shape[1] - 1)[None],
        ).logits  # fmt: skip
    return _nll(logits, fed[:, 1:])


def _record_scores(p: Any) -> dict[int, Any]:
    """Per layer, the scores the press computes: what ``score`` returns (a scorer press),
    or what the method scores on the statistics the press rebuilt (a head-adaptive one)."""
    out: dict[int, Any] = {}
    if hasattr(p, "score"):
        original = p.score

        def score(module: Any, *a: Any) -> Any:
            s = original(module, *a)
            out[int(module.layer_idx)] = s.detach()
            return s

        p.score = score
    else:
        original_stats = p.stats

        def stats(module: Any, hidden: Any, keys: Any, *a: Any) -> Any:
            st = original_stats(module, hidden, keys, *a)
            out[int(module.layer_idx)] = p.method.score_for_budget(st, p.kept(keys)).detach()
            return st

        p.stats = stats
    return out


def _masked_kept(model: Any, layers: list[int], t: int) -> dict[int, Any]:
    """Per layer, ``(B, G, T)`` bool: what kvpress keeps after a head-adaptive press
    (every entry but ``module.masked_key_indices``)."""
    import torch

    out = {}
    for i in layers:
        attn = model.model.layers[i].self_attn
        batch, head, position = attn.masked_key_indices
        keep = torch.ones(1, model.config.num_key_value_heads, t, dtype=torch.bool)
        keep[batch, head, position] = False
        out[i] = keep
    return out


def _mask(kept: Any, t: int) -> Any:
    """``(B, G, S)`` kept positions (−1: a padded slot) → ``(B, G, T)`` bool."""
    import torch

    mask = torch.zeros(*kept.shape[:-1], t + 1, dtype=torch.bool)
    mask.scatter_(-1, torch.where(kept < 0, t, kept), True)
    return mask[..., :t]


def _agreement(mine: Any, theirs: Any) -> float:
    """Share of our kept entries (over the layer's KV heads) that the press keeps too."""
    return float((mine & theirs).sum() / mine.sum())


def _nll(logits: Any, targets: Any) -> float:
    import torch

    logp = torch.log_softmax(logits.double(), dim=-1)
    return float(-logp.gather(-1, targets[..., None]).mean())


def _pipeline_check(model: Any, record: dict[str, Any], press: Any) -> dict[str, Any]:
    """kvpress's own pipeline accepts our presses: on the first item's context, our
    ``snapkv`` press answers as kvpress's SnapKVPress does, and ``contribution_sinks`` too."""
    import kvpress
    from transformers import AutoTokenizer, pipeline

    tok = AutoTokenizer.from_pretrained(record["model_dir"])
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    context = tok.decode(record["items"][0]["ids"][1 : record["context"]])
    question = "What is the text about?"
    presses = {
        "kvpress SnapKVPress": kvpress.SnapKVPress(compression_ratio=0.5),
        "ours snapkv": press("snapkv", 0.5),
        "ours contribution_sinks": press("contribution_sinks", 0.5),
    }
    answers = {
        name: pipe(context, question=question, press=p, max_new_tokens=16)["answer"]
        for name, p in presses.items()
    }
    return {
        "question": question,
        "ratio": 0.5,
        "max_new_tokens": 16,
        "answers": answers,
        "snapkv_same_answer": answers["kvpress SnapKVPress"] == answers["ours snapkv"],
    }


def _summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method: the worst score difference, the lowest kept agreement and the largest
    |ΔNLL| over items and ratios."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        s = out.setdefault(
            row["method"],
            {"method": row["method"], "score_max_abs_diff": 0.0, "kept_agreement_min": 1.0,
             "nll_max_abs_diff": 0.0},
        )  # fmt: skip
        s["score_max_abs_diff"] = max(s["score_max_abs_diff"], row.get("score_max_abs_diff", 0))
        s["kept_agreement_min"] = min(s["kept_agreement_min"], row.get("kept_agreement", 1))
        s["nll_max_abs_diff"] = max(
            s["nll_max_abs_diff"], abs(row["nll_ours"] - row["nll_kvpress"])
        )
        if "attention" in row:
            s["attention"] = row["attention"]
    return list(out.values())


def _print_summary(report: dict[str, Any]) -> None:
    print(f"{'method':22} {'attn':6} {'max|Δscore|':>12} {'kept agree':>11} {'max|ΔNLL|':>10}")
    for s in report["summary"]:
        print(
            f"{s['method']:22} {s.get('attention', ''):6} {s['score_max_abs_diff']:12.3g} "
            f"{s['kept_agreement_min']:11.4%} {s['nll_max_abs_diff']:10.3g}"
        )
    print("pipeline:", json.dumps(report["pipeline"]["answers"], ensure_ascii=False))


def _small(x: float) -> str:
    """A difference as the page prints it: one significant digit below 0.01 (1e-06), else
    two; 0 where the two sides are equal."""
    return "0" if x == 0 else f"{x:.1g}" if x < 0.01 else f"{x:.2g}"


def _scale(x: float) -> str:
    """A score's size: three significant digits, whole numbers from 100 on (10,412)."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def markdown(report: dict[str, Any]) -> str:
    """The report's table: per method (the uncompressed run first), over its items and
    ratios, the attention kernel, how many kept sets are identical, the lowest kept
    agreement, the largest score difference and score, and the largest |ΔNLL|; then
    whether our ``snapkv`` press answered as kvpress's SnapKVPress in kvpress's pipeline."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in report["rows"]:
        groups.setdefault(row["method"], []).append(row)
    ratios = ", ".join(f"{r:g}" for r in report["ratios"])
    lines = [
        f"kvpress {report['kvpress']}, transformers {report['transformers']}, torch "
        f"{report['torch']}; C = {report['context']}, {report['n_items']} items, ratios "
        f"{ratios}; {len(report['methods'])} methods",
        "",
        "| method | attention | kept sets identical (items × ratios) | lowest kept agreement "
        "| largest score difference | largest score | largest NLL difference |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for method, rows in groups.items():
        nll = _small(max(abs(r["nll_ours"] - r["nll_kvpress"]) for r in rows))
        if method == "none":
            lines.append(f"| none (uncompressed) |  |  |  |  |  | {nll} |")
            continue
        agreement = [r["kept_agreement"] for r in rows]
        identical = f"{sum(a == 1.0 for a in agreement)} / {len(rows)}"
        lowest = f"{100 * min(agreement):.1f}%"
        diff = _small(max(r["score_max_abs_diff"] for r in rows))
        scale = _scale(max(r["score_max_abs"] for r in rows))
        attention = rows[0]["attention"]
        lines.append(
            f"| `{method}` | {attention} | {identical} | {lowest} | {diff} | {scale} | {nll} |"
        )
    pipe = report.get("pipeline")
    if pipe is not None:
        same = "the same" if pipe["snapkv_same_answer"] else "a different"
        lines += [
            "",
            f"kvpress's pipeline (ratio {pipe['ratio']:g}, {pipe['max_new_tokens']} new tokens, "
            f"the first item's context): our `snapkv` press gives {same} answer as kvpress's "
            "SnapKVPress.",
        ]
    return "\n".join(lines) + "\n"


def write_table(out: Path, source: Path) -> int:
    """``--table OUT.md RESULT.json``: the Markdown table of a committed report."""
    out.write_text(markdown(json.loads(source.read_text())))
    print(f"wrote {out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--table", nargs=2, type=Path, metavar=("OUT.md", "RESULT.json"),
        help="write the table of a committed report and stop (no kvpress, no model)",
    )  # fmt: skip
    sub = p.add_subparsers(dest="side")
    a = sub.add_parser("ours", help="run in the project's environment")
    a.add_argument("--n", type=int, default=4, help="FineWeb-Edu items (default 4)")
    a.add_argument("--context", type=int, default=512, help="C, tokens prefilled (default 512)")
    a.add_argument("--ratios", type=lambda s: [float(x) for x in s.split(",")],
                   default=[0.25, 0.5, 0.75, 0.9])  # fmt: skip
    a.add_argument("--methods", default="all", help="methods (default: every registered one)")
    a.add_argument("--out", type=Path, required=True)
    b = sub.add_parser("kvpress", help="run in the kvpress environment")
    b.add_argument("--ours", type=Path, required=True)
    b.add_argument("--report", type=Path, required=True)
    args = p.parse_args()
    if args.table:
        return write_table(*args.table)
    if args.side is None:
        p.error("the following arguments are required: side (ours or kvpress), or --table")
    if args.side == "ours":
        ours(args)
    else:
        kvpress_side(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
