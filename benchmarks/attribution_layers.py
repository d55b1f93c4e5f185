"""Where contribution flow's scores come from: each layer's share of two tokens' scores.

``python benchmarks/attribution_layers.py [--model M] [--task induction] [--n 16] [--tokens 64]
[--run docs/results/attribution-…]``

For N known-answer items (``contribution_weights.attribution.tasks``), the flow
attribution of the answer's log-probability is split by where its terms come from
(``attribution.flow.layer_breakdown``: layer l's attention update and its feed-forward
update, each carried down to the inputs; the parts sum to the attribution). Reported per
layer and part, mean ± s.e. over items: the part of token 0's score (the first token, the
usual sink) and of the source token's score (where the answer comes from).

Then where the source's share is kept or lost on its way down: the *copying layer* (the
layer whose attention update at the target sends the largest direct term to the source
position, ``attribution.flow.target_step``), the part of that layer's direct term that
goes to the source position, and what the source position's state at the copying layer's
input is made of once carried down to the input tokens (its own token, token 0, the
others), with the residual share ρ of the source position at every layer below. And the
ranking of the ``direct`` method (method §7.6: every layer's update at the target credited
to the positions it read, one hop, nothing carried down), with the source's rank under
it; with ``--run`` (a finished ``cw attribution-eval`` run of the same items, checked by
flow's ranks), direct's top-1 against each of the run's methods (exact McNemar tests,
Holm-corrected). Writes a JSON and a figure. About 2 s an item on one thread for Gemma 3
270M at 64 tokens, measured beside two other runs (indicative, not a benchmark).

``python benchmarks/attribution_layers.py --table OUT.md RESULT.json ...`` writes the
Markdown tables of committed results (:func:`markdown`: one of every run's totals, a column
a run, then one per run of the layers whose parts are largest) and stops; it loads no model.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from _tables import plain as _plain  # benchmarks/_tables.py, beside this script
from _tables import signed as _signed


def source_hops(model: Any, fwd: Any, targets: list[Any], item: Any) -> dict[str, Any]:
    """The copying layer, its direct term's share on the source, the source position's
    state at that layer carried down to the tokens, and the one-hop (direct) rank."""
    import torch

    from contribution_weights.attribution.flow import (
        head_rows,
        mix,
        propagate,
        readout_directions,
        target_step,
    )
    from contribution_weights.experiments.attribution_eval import AttributionEval

    src = item.sources[0]
    stop = item.position + 1
    dt = fwd.final_x.dtype
    w, _ = readout_directions(model, fwd, targets)
    direct = torch.stack([target_step(f, fwd, w, stop, dt, "attention")[0] for f in fwd.layers])
    copying = int(direct[:, src].argmax())
    r = torch.zeros(1, stop, dtype=dt)
    r[0, src] = 1.0
    kept = [1.0] * (copying + 1)  # kept[l]: the source's own share at layer l's input
    for layer in range(copying - 1, -1, -1):
        r = mix("flow", fwd.layers[layer], r, fwd.block_bytes)
        kept[layer] = float(r[0, src])
    one_hop = propagate(model, fwd, targets, rule="direct").scores[0]  # the `direct` method
    return {
        "copying_layer": copying,
        "copy_share_to_source": float(direct[copying, src] / direct[copying].sum()),
        "source_state_on_source": float(r[0, src]),
        "source_state_on_token0": float(r[0, 0]),
        "source_state_on_others": float(1.0 - r[0, src] - r[0, 0]),
        "source_self_share_by_layer": kept,
        "source_rho_by_layer": [float(f.rho[src]) for f in fwd.layers],
        # at the source position, per layer: ‖u‖ / ‖x‖ (the attention update against the
        # residual it is added to), the head-mean attention on token 0, and the share of
        # y that the layer alone hands to token 0 through its heads
        "source_update_ratio_by_layer": [
            float((f.y[src] - f.x[src]).norm() / f.x[src].norm()) for f in fwd.layers
        ],
        "source_attention_to_token0_by_layer": [
            float(f.call.probs(slice(src, src + 1), keys=slice(0, src + 1))[0][:, 0, 0].mean())
            for f in fwd.layers
        ],
        "source_token0_share_by_layer": [
            float(head_rows(f, src, src + 1, dt)[0][:, 0].sum()) for f in fwd.layers
        ],
        # ranked as attribution-eval ranks a method's hits (token 0 out, ties: later first)
        "direct_rank": int(AttributionEval._hits(one_hop, item, True)["rank"]),
    }


def against_run(run: Path, hops: list[dict[str, Any]], flow_ranks: list[int]) -> list[dict]:
    """Direct's top-1 against every method of an attribution-eval run on the same items:
    exact McNemar tests (b: items direct finds and the method misses), Holm-corrected."""
    import pandas as pd

    from contribution_weights.experiments.paired import holm, mcnemar_p

    rows = pd.read_csv(run / "rows.csv")
    hits = rows[rows["kind"] == "hit"]
    flow = hits[hits["measure"] == "flow"].set_index("item")["rank"]
    n = len(hops)
    if len(flow) < n or any(float(flow[i]) != flow_ranks[i] for i in range(n)):
        raise SystemExit(f"{run} does not rank the same items as this benchmark's flow")
    direct = [h["direct_rank"] == 1 for h in hops]
    out = []
    for name, group in hits.groupby("measure", sort=False):
        hit = group.set_index("item")["hit1"]
        b = int(sum(direct[i] and hit[i] != 1 for i in range(n)))
        c = int(sum(hit[i] == 1 and not direct[i] for i in range(n)))
        top1 = float(hit.loc[list(range(n))].mean())
        out.append({"other": name, "other_top1": top1, "b": b, "c": c, "p": mcnemar_p(b, c)})
    for row, p_holm in zip(out, holm([r["p"] for r in out]), strict=True):
        row["p_holm"] = float(p_holm)
        print(f"direct against {row['other']}: {row['b']} items to {row['c']}, "
              f"p = {row['p']:.2g} (Holm {p_holm:.2g})")  # fmt: skip
    return out


MODELS = {"smollm2": "SmolLM2", "gemma3-270m": "Gemma 3"}
#: per run, the layers listed: the largest parts of each score, the smallest ρ at the source
TOP_PARTS = 4
LOW_RHO = 3


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _se(values: list[float]) -> float:
    """The standard error of the mean (n − 1 in the variance, as the run's ``std``)."""
    n, mean = len(values), _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else 0.0


def _name(result: dict[str, Any]) -> str:
    return f"{MODELS.get(result['model'], result['model'])} {result['task']}"


def _by_layer(result: dict[str, Any], key: str) -> list[float]:
    """``source_hops[*][key]``, the mean over items, per layer."""
    hops = result["source_hops"]
    return [_mean([h[key][layer] for h in hops]) for layer in range(len(hops[0][key]))]


def _copying(result: dict[str, Any]) -> list[tuple[int, int]]:
    """(copying layer, items), most items first."""
    counts: dict[int, int] = {}
    for h in result["source_hops"]:
        counts[h["copying_layer"]] = counts.get(h["copying_layer"], 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def listed_layers(result: dict[str, Any]) -> list[int]:
    """The layers a run's table lists: its most common copying layer, the layers of the
    ``TOP_PARTS`` largest parts (attention or feed-forward, by size) of token 0's score and
    of the source's, and the ``LOW_RHO`` layers with the smallest mean ρ at the source."""
    layers = (len(result["token0_by_layer"]["mean"]) - 1) // 2
    chosen = {_copying(result)[0][0]}
    for key in ("token0_by_layer", "source_by_layer"):
        mean = result[key]["mean"][: 2 * layers]
        largest = sorted(range(2 * layers), key=lambda i: -abs(mean[i]))[:TOP_PARTS]
        chosen |= {i % layers for i in largest}
    rho = _by_layer(result, "source_rho_by_layer")
    chosen |= set(sorted(range(layers), key=lambda layer: rho[layer])[:LOW_RHO])
    return sorted(chosen)


def summary_table(results: list[dict[str, Any]]) -> list[str]:
    """Every run's scores, split by block, and its copying layer: a column a run."""
    rows: list[tuple[str, list[str]]] = [("items × tokens", [])]
    for who in ("token 0", "source"):
        rows += [
            (f"{who}'s flow score (mean ± s.e.)", []),
            (f"{who}'s parts: attention, feed-forward, embedding", []),
        ]
    rows += [
        ("token 0's score above the source's (items)", []),
        ("source first among all positions (items)", []),
        ("flow's top-1 (token 0 out)", []),
        ("direct's top-1 (token 0 out)", []),
        ("copying layer (items)", []),
        ("its direct term on the source, of the layer's (mean, min to max)", []),
        ("source's state there, carried down: on its own token", []),
        ("… on token 0", []),
        ("… on the other tokens", []),
    ]
    for result in results:
        layers = (len(result["token0_by_layer"]["mean"]) - 1) // 2
        hops = result["source_hops"]
        share = [h["copy_share_to_source"] for h in hops]
        cells = [f"{result['n']} × {result['tokens']}"]
        for key in ("token0", "source"):
            totals, mean = result[f"{key}_total"], result[f"{key}_by_layer"]["mean"]
            parts = (sum(mean[:layers]), sum(mean[layers : 2 * layers]), mean[2 * layers])
            cells += [
                f"{_signed(_mean(totals))} ± {_plain(_se(totals), 3)}",
                ", ".join(_signed(x) for x in parts),
            ]
        above = zip(result["token0_total"], result["source_total"], strict=True)
        cells += [
            f"{sum(t > s for t, s in above)} of {result['n']}",
            f"{sum(r == 1 for r in result['source_rank_all'])} of {result['n']}",
            _plain(result["flow_top1"]),
            _plain(result["direct_top1"]),
            ", ".join(f"{layer} ({items})" for layer, items in _copying(result)),
            f"{_plain(_mean(share))} ({_plain(min(share))} to {_plain(max(share))})",
        ]
        cells += [
            _signed(_mean([h[f"source_state_on_{k}"] for h in hops]))
            for k in ("source", "token0", "others")
        ]
        for row, cell in zip(rows, cells, strict=True):
            row[1].append(cell)
    header = ["run", *(_name(r) for r in results)]
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * len(results)]
    return lines + ["| " + " | ".join([label, *cells]) + " |" for label, cells in rows]


def layer_table(result: dict[str, Any]) -> list[str]:
    """One run's listed layers (:func:`listed_layers`) and the rest in one row: the parts of
    token 0's and the source's scores, and what happens at the source position."""
    layers = (len(result["token0_by_layer"]["mean"]) - 1) // 2
    listed = listed_layers(result)
    rest = [layer for layer in range(layers) if layer not in listed]
    copying = _copying(result)[0][0]
    blocks = [(key, block) for key in ("token0", "source") for block in (0, layers)]
    at_source = [
        _by_layer(result, f"source_{key}_by_layer")
        for key in ("rho", "update_ratio", "attention_to_token0", "token0_share")
    ]
    hops = result["source_hops"]

    def kept(layer: int) -> str:
        """The source token's own share at the layer's output → input (items whose copying
        layer is above it)."""
        shares = [h["source_self_share_by_layer"] for h in hops if h["copying_layer"] > layer]
        if layer >= copying or not shares:
            return "—"
        out, into = _mean([s[layer + 1] for s in shares]), _mean([s[layer] for s in shares])
        return f"{_plain(out, 3)} → {_plain(into, 3)}"

    lines = []
    for layer in listed:
        cells = [f"{layer} (copying)" if layer == copying else str(layer)]
        for key, block in blocks:
            part = result[f"{key}_by_layer"]
            mean, se = part["mean"][block + layer], part["se"][block + layer]
            cells.append(f"{_signed(mean)} ± {_plain(se, 3)}")
        cells += [_plain(values[layer]) for values in at_source]
        cells.append(kept(layer))
        lines.append(cells)
    if rest:
        cells = [f"other {len(rest)} layers: sum; range"]
        for key, block in blocks:
            cells.append(_signed(sum(result[f"{key}_by_layer"]["mean"][block + i] for i in rest)))
        for values in at_source:
            low, high = min(values[i] for i in rest), max(values[i] for i in rest)
            cells.append(f"{_plain(low)} to {_plain(high)}")
        cells.append("")
        lines.append(cells)
    header = [
        f"{_name(result)}: layer",
        "token 0: attention",
        "token 0: feed-forward",
        "source: attention",
        "source: feed-forward",
        "ρ at source",
        "‖u‖/‖x‖ at source",
        "source's attention to token 0",
        "token 0's share of source's y",
        "source's own share, output → input",
    ]
    head = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    return head + ["| " + " | ".join(cells) + " |" for cells in lines]


def markdown(results: list[dict[str, Any]]) -> str:
    """Committed runs (one per model and task) as Markdown: a table of every run's scores
    and copying layer, then a table per run of its listed layers (:func:`listed_layers`)."""
    text = [
        "Flow scores of the answer's log-probability on token 0 and on the source, split by "
        "the block their terms come from (the parts sum to the score), and the copying layer: "
        "the layer whose attention update sends the largest direct term to the source "
        "position, with the source position's state at its input carried down to the tokens.",
        "",
        *summary_table(results),
        "",
        "Per run, per layer: the parts of token 0's and the source's scores from the layer's "
        "attention and feed-forward updates (mean ± s.e. over items) and, at the source "
        "position (means over items), the residual share ρ, the attention update's size "
        "against the residual it joins, the heads' mean attention to token 0, the share of "
        "the layer's y it alone hands to token 0, and the source token's own share of the "
        "position's state at the layer's output and input, carried down from the copying "
        "layer (items whose copying layer is above it; layer 0's input is the embeddings). "
        f"Listed: the most common copying layer, the layers of the {TOP_PARTS} largest parts "
        f"of each score and the {LOW_RHO} with the smallest ρ; the last row sums the other "
        "layers' parts and gives the range of their values.",
    ]
    for result in results:
        text += ["", *layer_table(result)]
    return "\n".join(text) + "\n"


def write_table(out: Path, sources: list[Path]) -> int:
    """``--table OUT.md RESULT.json ...``: the Markdown tables of committed results."""
    out.write_text(markdown([json.loads(source.read_text()) for source in sources]))
    print(f"wrote {out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--table", nargs="+", type=Path, metavar=("OUT.md", "RESULT.json"),
        help="write the tables of these results (one per model and task) and stop",
    )  # fmt: skip
    p.add_argument("--model", default=None)
    p.add_argument("--task", default="induction")
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument(
        "--run", type=Path, default=None,
        help="a finished cw attribution-eval run of the same items: compare direct's top-1 "
        "with its methods' (exact McNemar, Holm)",
    )  # fmt: skip
    args = p.parse_args()
    if args.table:
        if len(args.table) < 2:
            p.error("--table takes OUT.md and at least one RESULT.json")
        return write_table(args.table[0], args.table[1:])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    import contribution_weights as cw
    from contribution_weights.attribution.flow import forward_factors, layer_breakdown
    from contribution_weights.attribution.targets import Target
    from contribution_weights.attribution.tasks import make_item
    from contribution_weights.experiments.attribution_eval import AttributionEval

    model = cw.load_model(args.model)
    sink, source, ranks = [], [], []
    hops: list[dict[str, Any]] = []
    flow_ranks: list[int] = []  # the source's rank among positions 1 … p − 1 (token 0 out)
    for index in range(args.n):
        item = make_item(args.task, model.tokenizer, index, args.seed, args.tokens)
        ids = torch.tensor(item.ids)
        targets = [Target(item.position, item.answer, "logprob")]
        fwd, targets = forward_factors(model, ids, targets, keep_states=True)
        parts = layer_breakdown(model, fwd, targets, 0)  # (2L + 1, T')
        src = item.sources[0]
        sink.append(parts[:, 0].tolist())
        source.append(parts[:, src].tolist())
        total = parts.sum(0)
        hits = AttributionEval._hits(total, item, True)  # the eval's ranks of flow's scores
        ranks.append(int(hits["rank_all"]))
        flow_ranks.append(int(hits["rank"]))
        hop = source_hops(model, fwd, targets, item)
        hops.append(hop)
        print(f"item {index}: token 0 {float(total[0]):+.3f}, source {float(total[src]):+.3f}; "
              f"copying layer {hop['copying_layer']} sends {hop['copy_share_to_source']:.2f} of "
              f"its direct term to the source, whose state there keeps "
              f"{hop['source_state_on_source']:.3f} on its own token")  # fmt: skip

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
        "source_hops": hops,
        "direct_top1": sum(h["direct_rank"] == 1 for h in hops) / len(hops),
        "source_rank": flow_ranks,
        "flow_top1": sum(r == 1 for r in flow_ranks) / len(hops),
    }
    if args.run is not None:
        result["direct_against_run"] = against_run(args.run, hops, flow_ranks)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"attribution-layers-{model.name}-{args.task}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 3.8), width_ratios=[3, 2])
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
    # the source position's state at its copying layer, carried down: what stays on its token
    kept = [[h["source_self_share_by_layer"][x] for h in hops
             if x < len(h["source_self_share_by_layer"])] for x in xs]  # fmt: skip
    ax2.plot([x for x in xs if kept[x]], [sum(k) / len(k) for k in kept if k], marker="s",
             markersize=3, label="source state's share still on the source token")  # fmt: skip
    rho = [sum(h["source_rho_by_layer"][x] for h in hops) / len(hops) for x in xs]
    ax2.plot(
        xs, rho, marker="o", markersize=3, linestyle=":", label="ρ at the source (residual share)"
    )
    ax2.set_ylim(0, 1.1)
    ax2.set_xlabel("layer (input of)")
    ax2.set_title("the source position's own share, from its copying layer down", fontsize=9)
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out / f"{stem}.png", dpi=120)
    print(f"wrote {args.out}/{stem}.json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
