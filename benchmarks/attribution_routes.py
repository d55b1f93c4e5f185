"""Do the flow's routes (``cw attribute --routes``) go where the answer comes from?

``python benchmarks/attribution_routes.py [--model M] [--tasks induction,lookup,passkey]
[--n 32] [--tokens 64] [--top-heads 5] [--out DIR]``

Two things are known on the known-answer tasks (``contribution_weights.attribution.tasks``):
the source position the answer is copied from, and, independently of any attribution, the
heads that copy in context: **induction heads**, found by the standard prefix-matching
score (Olsson et al., 2022). On a random word sequence repeated once, the score of head
(l, h) is its mean attention from each token of the second copy to the token that followed
the same token in the first copy; the ``--top-heads`` highest are the induction heads.

For each item the routes of the answer's log-probability (default threshold, 2% of the
target's total flow) are read and scored:

* ``source_on_route``: the source position is a node of the route graph;
* ``copy_edge``: an edge goes from the source straight into the target position through a
  head (the copy step itself);
* ``copy_by_induction_head``: one such edge's head is an induction head.

Each rate is set against a control position of the same item: a position of the context
drawn by seed (not the source, not token 0, not the target), scored the same way. The
difference is paired over items (exact McNemar test; Wilson intervals for the rates).
``--resummarise`` rebuilds the summaries and tables of result files from their rows,
without the model.
Writes ``attribution-routes-{model}.json`` and ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np


def prefix_matching(
    model: Any, n: int, length: int, seed: int, words: list[int] | None = None
) -> np.ndarray:
    """``(L, H)`` prefix-matching score, the mean over ``n`` repeated random sequences of
    ``words`` (default: the tasks' single-token words)."""
    import torch

    from contribution_weights.attribution.flow import forward_factors
    from contribution_weights.attribution.targets import Target
    from contribution_weights.attribution.tasks import _prefix, word_pool

    words = word_pool(model.tokenizer) if words is None else words
    prefix = _prefix(model.tokenizer)
    a = len(prefix)
    scores = []
    for s in range(n):
        rng = np.random.default_rng([seed, s, 99])
        seq = [int(w) for w in rng.choice(words, size=length, replace=False)]
        ids = prefix + seq + seq
        t = len(ids)
        fwd, _ = forward_factors(model, torch.tensor(ids), [Target(t - 1, ids[-1], "logprob")])
        queries = torch.arange(a + length + 1, t)  # second copy, tokens 1 …: a key to match
        keys = queries - length + 1  # the token after the same token in the first copy
        per_layer = []
        for f in fwd.layers:
            assert f.call is not None
            probs = f.call.probs(slice(a + length + 1, t), keys=slice(0, t))[0]  # (H, Q, K)
            per_layer.append(probs[:, torch.arange(len(queries)), keys].mean(-1).double())
        scores.append(torch.stack(per_layer).cpu().numpy())
    return np.mean(scores, axis=0)


def _ranked(score: np.ndarray) -> list[tuple[int, int]]:
    """Every (layer, head), highest prefix-matching score first."""
    order = np.argsort(-score, axis=None, kind="stable")
    return [(int(i // score.shape[1]), int(i % score.shape[1])) for i in order]


def route_hits(routes: Any, position: int, where: int, heads: set[tuple[int, int]]) -> dict:
    """The three route scores of position ``where`` (see the module docstring)."""
    on_route = any(e.source == where for e in routes.edges)
    copies = [e for e in routes.edges if e.source == where and e.target == position and e.head >= 0]
    return {
        "copy_heads": [[e.layer, e.head, e.weight] for e in copies],
        "on_route": on_route,
        "copy_edge": bool(copies),
        "copy_by_induction_head": any((e.layer, e.head) in heads for e in copies),
    }


KEYS = ("on_route", "copy_edge", "copy_by_induction_head")


def summary_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each route score's rate at the source and at the control (Wilson 95% intervals), and
    the paired counts and exact McNemar p of source against control."""
    from contribution_weights.experiments.downstream import wilson_interval
    from contribution_weights.experiments.paired import mcnemar_p

    summary = {}
    for key in KEYS:
        s = [row["at_source"][key] for row in rows]
        c = [row["at_control"][key] for row in rows]
        b = sum(x and not y for x, y in zip(s, c, strict=True))
        d = sum(y and not x for x, y in zip(s, c, strict=True))
        summary[key] = {
            "source_rate": sum(s) / len(s), "source_wilson95": wilson_interval(sum(s), len(s)),
            "control_rate": sum(c) / len(c), "control_wilson95": wilson_interval(sum(c), len(c)),
            "source_only": b, "control_only": d, "mcnemar_p": mcnemar_p(b, d),
        }  # fmt: skip
    return summary


def copy_heads_of(rows: list[dict[str, Any]], score: np.ndarray, most: int = 5) -> list[list]:
    """The ``most`` heads of the source's copy edges in the most items: ``[layer, head,
    items, prefix-matching score, rank]``."""
    rank = {lh: r + 1 for r, lh in enumerate(_ranked(score))}
    counts = Counter(
        lh for row in rows for lh in {(c[0], c[1]) for c in row["at_source"]["copy_heads"]}
    )
    return [[lh[0], lh[1], n, float(score[lh]), rank[lh]] for lh, n in counts.most_common(most)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--tasks", default="induction,lookup,passkey")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="item length (passkey: twice this)")
    p.add_argument("--top-heads", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    p.add_argument("--resummarise", type=Path, nargs="+", default=[], metavar="JSON")
    args = p.parse_args()
    for path in args.resummarise:
        resummarise(path)
    if args.resummarise:
        return 0

    import torch

    import contribution_weights as cw
    from contribution_weights.attribution.tasks import make_item

    torch.manual_seed(args.seed)
    model = cw.load_model(args.model)
    score = prefix_matching(model, n=8, length=24, seed=args.seed)
    top = _ranked(score)[: args.top_heads]
    heads = set(top)
    print("induction heads (layer, head, prefix-matching score):",
          [(lh[0], lh[1], round(float(score[lh]), 3)) for lh in top])  # fmt: skip
    tasks: dict[str, Any] = {}
    for task in args.tasks.split(","):
        tokens = 2 * args.tokens if task == "passkey" else args.tokens
        rows: list[dict[str, Any]] = []
        for index in range(args.n):
            item = make_item(task, model.tokenizer, index, args.seed, tokens)
            src = item.sources[0]
            rng = np.random.default_rng([args.seed, index, 7])
            others = [j for j in range(1, item.position) if j != src]
            control = int(rng.choice(others))
            result = cw.attribute(
                model, item.ids, token=int(item.answer), methods="flow", routes=True,
                progress=False,
            )  # fmt: skip
            assert result.routes is not None
            r = result.routes[0]
            rows.append({
                "item": index, "source": src, "control": control, "edges": len(r.edges),
                "at_source": route_hits(r, item.position, src, heads),
                "at_control": route_hits(r, item.position, control, heads),
            })  # fmt: skip
        summary = summary_of(rows)
        tasks[task] = {
            "tokens": tokens,
            "summary": summary,
            "copy_heads": copy_heads_of(rows, score),
            "rows": rows,
        }
        print(task, json.dumps(summary))
    out = {
        "model": model.name,
        "n": args.n,
        "seed": args.seed,
        "threshold": 0.02,
        "induction_heads": [[lh[0], lh[1], float(score[lh])] for lh in top],
        "prefix_matching": score.tolist(),
        "tasks": tasks,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"attribution-routes-{model.name}"
    (args.out / f"{stem}.json").write_text(json.dumps(out, indent=1))
    (args.out / f"{stem}.md").write_text(markdown(out))
    print(markdown(out))
    return 0


def resummarise(path: Path) -> None:
    """A result's summaries and copy heads rebuilt from its rows, rewritten with its table."""
    out = json.loads(path.read_text())
    score = np.array(out["prefix_matching"])
    for t in out["tasks"].values():
        t["summary"] = summary_of(t["rows"])
        t["copy_heads"] = copy_heads_of(t["rows"], score)
    path.write_text(json.dumps(out, indent=1))
    path.with_suffix(".md").write_text(markdown(out))


def markdown(out: dict[str, Any]) -> str:
    """The hit-rate table of a result (the JSON's ``tasks``)."""
    heads = ", ".join(f"L{lh[0]}.H{lh[1]} ({lh[2]:.2f})" for lh in out["induction_heads"])
    lines = [
        f"Model {out['model']}, {out['n']} items per task, routes at threshold "
        f"{out['threshold']}; induction heads by prefix-matching score: {heads}.",
        "",
        "| task | route score | source | control | source only / control only | McNemar p |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for task, t in out["tasks"].items():
        for key, s in t["summary"].items():
            lo, hi = s["source_wilson95"]
            clo, chi = s["control_wilson95"]
            lines.append(
                f"| {task} | {key} | {s['source_rate']:.2f} [{lo:.2f}, {hi:.2f}] | "
                f"{s['control_rate']:.2f} [{clo:.2f}, {chi:.2f}] | "
                f"{s['source_only']} / {s['control_only']} | {s['mcnemar_p']:.2g} |"
            )
    lines += ["", "Heads of the source's copy edges (items; prefix-matching score, rank of "
              f"{len(out['prefix_matching']) * len(out['prefix_matching'][0])}):", ""]  # fmt: skip
    for task, t in out["tasks"].items():
        heads = ", ".join(
            f"L{c[0]}.H{c[1]} in {c[2]} ({c[3]:.2f}, #{c[4]})" for c in t["copy_heads"]
        )
        lines.append(f"- {task}: {heads or 'none'}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
