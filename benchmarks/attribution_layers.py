"""Where contribution flow's scores come from: each layer's share of two tokens' scores.

``python benchmarks/attribution_layers.py [--task induction] [--n 16] [--tokens 64]``

For N known-answer items (``contribution_weights.attribution.tasks``), the flow
attribution of the answer's log-probability is split by where its terms come from
(``attribution.flow.layer_breakdown``: layer l's attention update and its feed-forward
update, each carried down to the inputs; the parts sum to the attribution). Reported per
layer and part, mean ± s.e. over items: the part of token 0's score (the first token, the
usual sink) and of the source token's score (where the answer comes from). Writes a JSON
and a figure.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--task", default="induction")
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    args = p.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    import contribution_weights as cw
    from contribution_weights.attribution.flow import forward_factors, layer_breakdown
    from contribution_weights.attribution.targets import Target
    from contribution_weights.attribution.tasks import make_item

    model = cw.load_model(args.model)
    sink, source, ranks = [], [], []
    for index in range(args.n):
        item = make_item(args.task, model.tokenizer, index, args.seed, args.tokens)
        ids = torch.tensor(item.ids)
        targets = [Target(item.position, item.answer, "logprob")]
        fwd, targets = forward_factors(model, ids, targets)
        parts = layer_breakdown(model, fwd, targets, 0)  # (2L + 1, T')
        src = item.sources[0]
        sink.append(parts[:, 0].tolist())
        source.append(parts[:, src].tolist())
        total = parts.sum(0)
        ranks.append(int((total[: item.position] > total[src]).sum()) + 1)
        print(f"item {index}: token 0 {float(total[0]):+.3f}, source {float(total[src]):+.3f}")

    def stats(rows: list[list[float]]) -> tuple[list[float], list[float]]:
        t = torch.tensor(rows)
        se = t.std(0) / math.sqrt(t.shape[0]) if t.shape[0] > 1 else torch.zeros(t.shape[1])
        return t.mean(0).tolist(), se.tolist()

    sink_mean, sink_se = stats(sink)
    source_mean, source_se = stats(source)
    layers = (len(sink_mean) - 1) // 2
    result = {
        "model": model.name,
        "task": args.task,
        "n": args.n,
        "tokens": args.tokens,
        "rows": "attention of layers 0..L-1, feed-forward of layers 0..L-1, the embedding",
        "token0_by_layer": {"mean": sink_mean, "se": sink_se},
        "source_by_layer": {"mean": source_mean, "se": source_se},
        "source_rank_all": ranks,
        "token0_total": [sum(r) for r in sink],
        "source_total": [sum(r) for r in source],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"attribution-layers-{model.name}-{args.task}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    xs = list(range(layers))
    for name, mean, se, marker in (
        ("token 0", sink_mean, sink_se, "o"),
        ("source", source_mean, source_se, "s"),
    ):
        for part, sl, dash in (
            ("attention", slice(0, layers), "-"),
            ("feed-forward", slice(layers, 2 * layers), ":"),
        ):
            ax.errorbar(xs, mean[sl], yerr=se[sl], label=f"{name}, {part}", marker=marker,
                        linestyle=dash, markersize=3, capsize=2)  # fmt: skip
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xlabel("layer whose updates the score comes from")
    ax.set_ylabel("part of the token's flow score")
    ax.set_title(f"flow on {args.task} ({model.name}, n = {args.n}, {args.tokens} tokens): "
                 "which layers score token 0 and the source", fontsize=9)  # fmt: skip
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out / f"{stem}.png", dpi=120)
    print(f"wrote {args.out}/{stem}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
