"""Cross-check of ``contribution_weights.kv`` against kvpress 0.5.5, the reference library.

kvpress 0.5.5 pins ``transformers < 5.3`` while this package needs 5.24, so the check runs
in two environments and meets in one file::

    # 1. ours (the project's .venv): scores, kept sets and NLL, plus the inputs
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kvpress_crosscheck.py ours --out xc.pt
    # 2. kvpress (its own venv, see benchmarks/kvpress-requirements.txt): the same inputs
    #    through kvpress's presses on the same weights, compared with step 1
    OMP_NUM_THREADS=1 /path/to/kvpress-venv/bin/python benchmarks/kvpress_crosscheck.py \\
        kvpress --ours xc.pt --report xc.json

Setting up the kvpress environment (not part of ``make test``)::

    python3 -m venv /work/kvpress-venv
    /work/kvpress-venv/bin/pip install torch==2.13.0    # CPU wheel, first
    /work/kvpress-venv/bin/pip install -r benchmarks/kvpress-requirements.txt

Model: SmolLM2-135M (the package's embedded model), loaded in the kvpress environment
with plain transformers from the dequantised safetensors folder that ``cw.load_model()``
writes (its path is stored in the file of step 1), in float32 with eager attention (kvpress's
ObservedAttentionPress needs the attention weights).

Inputs: the first ``--n`` FineWeb-Edu LM items of ``C + 129`` tokens (as ``cw kv-eval``).
For every method both libraries have and ratio, the report gives the largest score
difference (methods whose scores do not depend on the ratio), the fraction of our kept
entries that kvpress keeps too, and both NLLs of the next 128 tokens. Five are defined
alike on both sides (StreamingLLM, observed attention, SnapKV, TOVA, key norm) and KeyDiff
too; three differ by design, and the report measures by how much (docs/kv-cache.md says
why): CriticalKV's stage 2 weighs by the L2 norm of W_O v (kvpress: L1); Expected
Attention takes the query mean and covariance from the window's queries after RoPE
(kvpress: every query but the sinks, before RoPE, turned by the mean rotation of the next
512 positions); AdaKV rounds its safeguard up (kvpress: down).
AdaKV needs kvpress's sdpa path (its attention patch masks the evicted keys per head), so
that method runs on a second copy of the model with sdpa attention.

The table of a committed report (read from the JSON alone: neither kvpress nor torch is
imported, so it runs in the project's .venv)::

    .venv/bin/python benchmarks/kvpress_crosscheck.py --table \\
        docs/results/kvpress-crosscheck-smollm2-fineweb-edu-512.md \\
        docs/results/kvpress-crosscheck-smollm2-fineweb-edu-512.json

``markdown(report)`` gives it: a line of what the report records (versions, C, items), then
per method and ratio (and the uncompressed run first) the items whose kept sets are
identical, the mean share of our kept entries kvpress keeps too, the largest score
difference and the largest score (methods whose scores do not depend on the ratio) and the
largest |NLL ours − NLL kvpress| over the items.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from _timing import data_dir, plain_models  # benchmarks/_timing.py, beside this script

# ours -> kvpress press name (a wrapper press: "Wrapper(Inner)")
SHARED_METHODS = {
    "streaming_llm": "StreamingLLMPress",
    "observed_attention": "ObservedAttentionPress",
    "snapkv": "SnapKVPress",
    "tova": "TOVAPress",
    "knorm": "KnormPress",
    "keydiff": "KeyDiffPress",
    "criticalkv": "CriticalKVPress(SnapKVPress)",
    "expected_attention": "ExpectedAttentionPress",
    "adakv_snapkv": "AdaKVPress(SnapKVPress)",
}
# scores independent of the ratio, compared directly
RATIO_FREE = {"observed_attention", "snapkv", "tova", "knorm", "keydiff", "expected_attention"}
#: kvpress presses that need its sdpa path
SDPA = {"adakv_snapkv"}


def ours(args: argparse.Namespace) -> None:
    import torch

    import contribution_weights as cw
    from contribution_weights.kv.evaluate import lm_item, lm_items, lm_score

    data_dir()  # $CW_DATA_DIR, checked
    model = cw.load_model()
    texts = cw.data.load_texts("fineweb-edu")
    record: dict[str, Any] = {
        "model_dir": str(model.model.name_or_path),
        "context": args.context,
        "ratios": args.ratios,
        "items": [],
    }
    for ids in lm_items(model, texts, args.context, args.n):
        prefix, fed = lm_item(ids, args.context)
        pre = cw.kv.prefill(model, prefix)
        item: dict[str, Any] = {"ids": ids, "scores": {}, "kept": {}, "nll": {}}
        item["nll"]["none"] = lm_score(model, cw.kv.compress(pre, "knorm", 0.0), fed)["nll"]
        for method in SHARED_METHODS:
            spec = cw.kv.get_method(method)
            item["scores"][method] = {i: spec.score(s).float() for i, s in pre.stats.items()}
            for ratio in args.ratios:
                small = cw.kv.compress(pre, method, ratio)
                item["kept"][(method, ratio)] = {
                    i: _mask(k, pre.length) for i, k in small.kept.items()
                }
                item["nll"][(method, ratio)] = lm_score(model, small, fed)["nll"]
        record["items"].append(item)
        print(f"ours: item {len(record['items'])} done")
    torch.save(record, args.out)
    print(f"wrote {args.out} (model folder {record['model_dir']})")


def kvpress_side(args: argparse.Namespace) -> None:
    import kvpress
    import torch
    import transformers
    from transformers import DynamicCache

    record = torch.load(args.ours, weights_only=False)
    models = plain_models(record["model_dir"])
    model = models["eager"]
    c = record["context"]
    report: dict[str, Any] = {
        "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model_dir": record["model_dir"],
        "context": c,
        "n_items": len(record["items"]),
        "rows": [],
    }
    for n_item, item in enumerate(record["items"]):
        ids = item["ids"][None]
        prefix, fed = ids[:, :c], ids[:, c : c + 129]
        with torch.no_grad():
            cache = DynamicCache()
            model(input_ids=prefix, past_key_values=cache)
            logits = model(
                input_ids=fed[:, :-1], past_key_values=cache,
                position_ids=torch.arange(c, c + 128)[None],
            ).logits  # fmt: skip
        base = _nll(logits, fed[:, 1:])
        report["rows"].append(
            {"item": n_item, "method": "none", "ratio": 0.0, "nll_ours": item["nll"]["none"],
             "nll_kvpress": base}
        )  # fmt: skip
        for method, press_name in SHARED_METHODS.items():
            run = models["sdpa" if method in SDPA else "eager"]
            for ratio in record["ratios"]:
                press = _press(kvpress, press_name, ratio)
                scores: list[Any] = []  # per layer, (B, G, T)
                evicted: list[Any] = []  # AdaKV: per layer, the (b, g, t) indices it masks
                scorer = press.press if press_name.startswith("AdaKV") else press
                original = scorer.score

                def score(*a: Any, _orig: Any = original, _out: list[Any] = scores) -> Any:
                    s = _orig(*a)
                    _out.append(s.detach().float().clone())
                    return s

                scorer.score = score  # type: ignore[method-assign]
                if press_name.startswith("AdaKV"):
                    compress = press.compress

                    def masked(
                        module: Any, *a: Any, _orig: Any = compress, _out: list[Any] = evicted
                    ) -> Any:
                        out = _orig(module, *a)
                        _out.append(module.masked_key_indices)
                        return out

                    press.compress = masked  # type: ignore[method-assign]
                with torch.no_grad(), press(run):
                    cache = DynamicCache()
                    run(input_ids=prefix, past_key_values=cache)
                with torch.no_grad():
                    logits = run(
                        input_ids=fed[:, :-1], past_key_values=cache,
                        position_ids=torch.arange(c, c + 128)[None],
                    ).logits  # fmt: skip
                if evicted:
                    theirs = []
                    for s, (b, g, t) in zip(scores, evicted, strict=True):
                        keep = torch.ones(s.shape, dtype=torch.bool)
                        keep[b, g, t] = False
                        theirs.append(keep)
                else:
                    theirs = [_mask(_top(s, ratio), s.shape[-1]) for s in scores]
                mine = item["kept"][(method, ratio)]
                layers = sorted(mine)
                ours_kept = sum(int(mine[i].sum()) for i in layers)
                shared = sum(int((mine[i] & theirs[k]).sum()) for k, i in enumerate(layers))
                row = {
                    "item": n_item,
                    "method": method,
                    "ratio": ratio,
                    "kept_agreement": shared / ours_kept,
                    "kept_ours": ours_kept,
                    "kept_kvpress": sum(int(t.sum()) for t in theirs),
                    "nll_ours": item["nll"][(method, ratio)],
                    "nll_kvpress": _nll(logits, fed[:, 1:]),
                }
                if method in RATIO_FREE:
                    row["score_max_abs_diff"] = max(
                        float((item["scores"][method][i] - scores[i]).abs().max())
                        for i in sorted(mine)
                    )
                    row["score_max_abs"] = max(float(s.abs().max()) for s in scores)
                report["rows"].append(row)
        print(f"kvpress: item {n_item + 1} done")
    Path(args.report).write_text(json.dumps(report, indent=2))
    _print_summary(report)


def _nll(logits: Any, targets: Any) -> float:
    import torch

    logp = torch.log_softmax(logits.double(), dim=-1)
    return float(-logp.gather(-1, targets[..., None]).mean())


def _mask(kept: Any, length: int) -> Any:
    """``(B, G, S)`` kept positions (−1: a padded slot) → ``(B, G, length)`` booleans."""
    import torch

    out = torch.zeros(*kept.shape[:-1], length + 1, dtype=torch.bool)
    out.scatter_(-1, kept.long().where(kept >= 0, length), True)  # padded slots: the extra column
    return out[..., :length]


def _top(scores: Any, ratio: float) -> Any:
    """The positions a kvpress ScorerPress keeps: its top ``int(T · (1 − ratio))``."""
    return scores.topk(max(1, int(scores.shape[-1] * (1 - ratio))), dim=-1).indices


def _press(kvpress: Any, name: str, ratio: float) -> Any:
    """A kvpress press by name; ``Wrapper(Inner)`` wraps a fresh inner press."""
    if "(" in name:
        outer, inner = name.rstrip(")").split("(")
        return getattr(kvpress, outer)(press=getattr(kvpress, inner)(compression_ratio=ratio))
    return getattr(kvpress, name)(compression_ratio=ratio)


def _print_summary(report: dict[str, Any]) -> None:
    import pandas as pd

    df = pd.DataFrame(report["rows"])
    df["nll_abs_diff"] = (df["nll_ours"] - df["nll_kvpress"]).abs()
    agg = {"kept_agreement": "mean", "nll_abs_diff": "max", "nll_ours": "mean",
           "nll_kvpress": "mean"}  # fmt: skip
    if "score_max_abs_diff" in df:
        agg["score_max_abs_diff"] = "max"
    print(df.groupby(["method", "ratio"], sort=False).agg(agg).to_string(float_format="%.4g"))


def _small(x: float) -> str:
    """A difference as the page prints it: one significant digit below 0.01 (0.004, 9e-06),
    else two (0.45); 0 where the two sides are equal."""
    return "0" if x == 0 else f"{x:.1g}" if x < 0.01 else f"{x:.2g}"


def _scale(x: float) -> str:
    """A score's size: three significant digits, whole numbers from 100 on (10,412)."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def markdown(report: dict[str, Any]) -> str:
    """The report's table: per method and ratio (the uncompressed run first), over the
    items, how many kept sets are identical, the mean kept agreement, the largest score
    difference and score (ratio-free methods only), and the largest |ΔNLL|."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for row in report["rows"]:
        groups.setdefault((row["method"], row["ratio"]), []).append(row)
    lines = [
        f"kvpress {report['kvpress']}, transformers {report['transformers']}, torch "
        f"{report['torch']}; C = {report['context']}, {report['n_items']} items",
        "",
        "| method | kvpress press | ratio | items with identical kept sets "
        "| kept agreement, mean | largest score difference | largest score "
        "| largest NLL difference |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (method, ratio), rows in groups.items():
        nll = _small(max(abs(r["nll_ours"] - r["nll_kvpress"]) for r in rows))
        if method == "none":
            lines.append(f"| none (uncompressed) |  |  |  |  |  |  | {nll} |")
            continue
        agreement = [r["kept_agreement"] for r in rows]
        identical = f"{sum(a == 1.0 for a in agreement)} / {len(rows)}"
        mean = f"{100 * sum(agreement) / len(agreement):.1f}%"
        if all("score_max_abs_diff" in r for r in rows):
            diff = _small(max(r["score_max_abs_diff"] for r in rows))
            scale = _scale(max(r["score_max_abs"] for r in rows))
        else:
            diff = scale = ""
        press = f"`{SHARED_METHODS.get(method, '')}`"
        lines.append(
            f"| `{method}` | {press} | {ratio:g} | {identical} | {mean} | {diff} | {scale} "
            f"| {nll} |"
        )
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
