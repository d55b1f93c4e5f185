"""What evicting the sink token does, next to what its contribution says (docs/kv-cache.md).

``python benchmarks/kv_sinks.py [--model smollm2] [--n 8] [--context 512] [--out FILE]``

``python benchmarks/kv_sinks.py --table OUT.md RESULT.json ...`` writes the Markdown table of
committed results (a column per result, one per model: :func:`markdown`) and stops; it runs
no model.

On the first ``--n`` FineWeb-Edu LM items (``cw kv-eval``'s items), after a prefill of C
tokens, the NLL of the next 128 tokens when token 0 is

* kept (the full cache);
* evicted from every compressible layer's cache: the softmax renormalises over the rest
  (what any KV-cache method does);
* removed the faithfulness way (method §4): its attention column multiplied by 0 on the
  capture path, without renormalising (what ĉ measures);

and, from the prefill's last-64-query window, token 0's share of the attention
(mean over heads of α_i0) and of the absolute contribution (Σ|ĉ_i0| / Σ_j |ĉ_ij|).

The output keeps every item's row (``items``) and the paired differences of the three NLLs
on the same items (``paired``: evicted − kept, zeroed − kept, evicted − zeroed; mean, s.e.,
percentile-bootstrap 95% interval, the paired t-test's p and its Holm correction over the three).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from pathlib import Path
from typing import Any

from _timing import data_dir  # benchmarks/_timing.py, beside this script


class _ZeroFirstColumn:
    """Capture intervention: multiply attention column 0 by 0 in the given layers."""

    def __init__(self, layers: set[int]) -> None:
        self.layers = layers

    def column_scale(self, call: Any) -> Any:
        import torch

        if call.layer_idx not in self.layers:
            return None
        scale = torch.ones(call.batch, call.num_heads, call.k_len, dtype=call.query.dtype)
        scale[..., 0] = 0
        return scale


def _paired(rows: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Paired differences of the NLLs over the same items: mean, s.e., bootstrap 95%
    interval, paired t-test p."""
    import numpy as np

    from contribution_weights.experiments.paired import bootstrap_interval, holm, t_test

    out: dict[str, dict[str, float]] = {}
    for name, a, b in (("evicted_minus_kept", "nll_evicted", "nll_full"),
                       ("zeroed_minus_kept", "nll_zeroed", "nll_full"),
                       ("evicted_minus_zeroed", "nll_evicted", "nll_zeroed")):  # fmt: skip
        d = np.array([r[a] - r[b] for r in rows])
        low, high = bootstrap_interval(d)
        se = float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else float("nan")
        out[name] = {"mean": float(d.mean()), "se": se, "ci_low": low, "ci_high": high,
                     "p": t_test(d)}  # fmt: skip
    for entry, corrected in zip(out.values(), holm([e["p"] for e in out.values()]), strict=True):
        entry["p_holm"] = float(corrected)  # Holm over the three differences
    return out


def item_row(model: Any, ids: Any, c: int, continuation: int = 128) -> dict[str, float]:
    """One item's row: the continuation's NLL with token 0 kept, evicted (renormalised) and
    zeroed (not renormalised), through the capture path with nothing zeroed as a check, and
    token 0's shares of the window's attention and absolute contribution. ``ids``: the
    item's ``(1, ·)`` ids: ``c`` prefill tokens and the ``continuation + 1`` after them."""
    import torch

    import contribution_weights as cw
    from contribution_weights.capture import capturing
    from contribution_weights.kv.evaluate import continuation_nll

    net = model.model
    cache_key = cw.kv.cache_keyword(net)  # the name this transformers reads the cache by
    prefix, fed = ids[:, :c], ids[:, c : c + continuation + 1]
    pre = cw.kv.prefill(model, prefix)
    pos = torch.arange(c, c + fed.shape[1] - 1)[None]
    layers = set(pre.stats)

    def nll(cache: Any, intervention: Any = None) -> float:
        kwargs = {"input_ids": fed[:, :-1], "position_ids": pos, cache_key: cache}
        with torch.no_grad():
            if intervention is None:
                logits = net(**kwargs).logits
            else:
                with capturing(net, intervention=intervention):
                    logits = net(**kwargs).logits
        return continuation_nll(logits, fed[:, 1:])

    evicted = copy.deepcopy(pre.cache)
    for i in layers:
        evicted.layers[i].keys = evicted.layers[i].keys[:, :, 1:].contiguous()
        evicted.layers[i].values = evicted.layers[i].values[:, :, 1:].contiguous()
    alpha = [float(s.window_probs[..., 0].mean()) for s in pre.stats.values()]
    share = [
        float((s.window_contribution[..., 0] / s.window_contribution.sum(-1)).mean())
        for s in pre.stats.values()
    ]
    return {
        "nll_full": nll(copy.deepcopy(pre.cache)),
        "nll_full_capture": nll(copy.deepcopy(pre.cache), _ZeroFirstColumn(set())),
        "nll_evicted": nll(evicted),
        "nll_zeroed": nll(copy.deepcopy(pre.cache), _ZeroFirstColumn(layers)),
        "alpha_share_token0": statistics.mean(alpha),
        "contribution_share_token0": statistics.mean(share),
    }


#: the table's names for the models (the others are named as they are)
MODELS = {"smollm2": "SmolLM2", "gemma3-270m": "Gemma 3"}

#: the table's rows of paired NLL differences: (label, key in ``paired``)
PAIRED_ROWS = (
    ("evicting token 0: evicted − kept, nats [95% interval]", "evicted_minus_kept"),
    ("zeroing token 0: zeroed − kept, nats [95% interval]", "zeroed_minus_kept"),
    ("evicted − zeroed, nats [95% interval]", "evicted_minus_zeroed"),
)

#: the table's rows of token 0's shares of the window's mass: (label, key)
SHARE_ROWS = (
    ("token 0's share of the window's attention α (± s.e.)", "alpha_share_token0"),
    ("token 0's share of the window's \\|ĉ\\| (contribution, ± s.e.)", "contribution_share_token0"),
)


def _signed(x: float) -> str:
    return f"{x:+.3f}".replace("-", "−")


def _interval(entry: dict[str, float]) -> str:
    """Mean [95% bootstrap interval], as the page prints them (+0.922 [+0.824, +1.023])."""
    return f"{_signed(entry['mean'])} [{_signed(entry['ci_low'])}, {_signed(entry['ci_high'])}]"


def _p(p: float) -> str:
    """A p-value as the page prints it: one significant digit below 0.01 (4e-12), else two
    (0.061); 0 where the t distribution's tail underflows."""
    return "0" if p == 0 else f"{p:.1g}" if p < 0.01 else f"{p:.2g}"


def markdown(results: list[dict[str, Any]]) -> str:
    """One table, a column per result (a model), a row per quantity: the paired NLL
    differences over the items (mean [95% bootstrap interval]), the paired t-test's p of
    evicted − zeroed, and token 0's mean shares of the window's attention and absolute
    contribution (mean ± s.e. over items)."""
    header = ["quantity"]
    for result in results:
        header.append(MODELS.get(result["model"], result["model"]))
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * len(results)]
    for label, key in PAIRED_ROWS:
        cells = [_interval(r["paired"][key]) for r in results]
        lines.append("| " + " | ".join([label, *cells]) + " |")
    cells = [_p(r["paired"]["evicted_minus_zeroed"]["p"]) for r in results]
    lines.append("| " + " | ".join(["evicted − zeroed: p (paired t-test)", *cells]) + " |")
    for label, key in SHARE_ROWS:
        cells = [f"{r[key]:.3f} ± {r[key + '_se']:.3f}" for r in results]
        lines.append("| " + " | ".join([label, *cells]) + " |")
    return "\n".join(lines) + "\n"


def write_table(out: Path, sources: list[Path]) -> int:
    """``--table OUT.md RESULT.json ...``: the Markdown table of committed results."""
    out.write_text(markdown([json.loads(source.read_text()) for source in sources]))
    print(f"wrote {out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--table", nargs="+", type=Path, metavar=("OUT.md", "RESULT.json"),
        help="write the table of these results (one per model) and stop",
    )  # fmt: skip
    p.add_argument("--model", default=None)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.table:
        if len(args.table) < 2:
            p.error("--table takes OUT.md and at least one RESULT.json")
        return write_table(args.table[0], args.table[1:])
    data_dir()  # $CW_DATA_DIR, checked

    import contribution_weights as cw
    from contribution_weights.kv.evaluate import CONTINUATION, lm_items

    model = cw.load_model(args.model)
    c = args.context
    rows = []
    for ids in lm_items(model, cw.data.load_texts("fineweb-edu"), c, args.n):
        rows.append(item_row(model, ids[None], c, CONTINUATION))  # lm_item's split
        print(json.dumps(rows[-1]))
    summary = {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
    if len(rows) < 2:
        raise SystemExit("--n must give at least 2 items for standard errors")
    sem = {k + "_se": statistics.stdev(r[k] for r in rows) / len(rows) ** 0.5 for k in rows[0]}
    result = {"model": model.name, "context": c, "n": len(rows), **summary, **sem,
              "paired": _paired(rows), "items": rows}  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
