"""How much of one prediction the first token (the usual attention sink) gets, by method.

``python benchmarks/attribution_first_token.py [--model gemma3-270m] [--text "..."]``

For one text, the next-token prediction at the last position is attributed three ways:
the pure contribution flow (``quantity="flow"``, a decomposition of the final state), flow
projected on the predicted token's log-probability, and input × gradient. Beside them,
layer by layer, the last position's mixing row (``attribution.flow.mix`` applied to a
one-hot row: the shares of its attention block's output ``y`` that each token carries,
its own residual included; they sum to 1): token 0's share and the position's own share.
Writes ``attribution-first-token-{model}.json``; prints token 0's share by each method and
the layers where its share of ``y`` is largest.

``python benchmarks/attribution_first_token.py --table OUT.md RESULT.json ...`` writes the
Markdown tables of committed results (:func:`markdown`: two small ones per model) and stops;
it loads no model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from _tables import plain as _plain  # benchmarks/_tables.py, beside this script
from _tables import signed as _signed

TEXT = "The capital of France is Paris. The capital of Germany is"
MODELS = {"smollm2": "SmolLM2", "gemma3-270m": "Gemma 3"}
#: the methods as the table names them, in its order
METHODS = {
    "pure_flow": "pure flow (the final state)",
    "flow_logprob": "flow of log P({predicted})",
    "input_x_gradient": "input × gradient of log P({predicted})",
}
#: the layers the mixing-row table lists: those where token 0's share of y is largest
TOP_LAYERS = 3


def _code(token: str) -> str:
    """A token or text quoted as code (so that ``<bos>`` shows), pipes escaped for tables."""
    return f'`"{token}"`'.replace("|", "\\|")


def tables(result: dict[str, Any]) -> list[str]:
    """One model's two tables: token 0's score and share by method, and the last
    position's mixing row at the ``TOP_LAYERS`` layers where token 0's share is largest."""
    name = MODELS.get(result["model"], result["model"])
    predicted = _code(result["predicted"])
    lines = [
        f"{name}: {_code(result['text'])} → {predicted}, {len(result['tokens'])} tokens, "
        f"token 0 {_code(result['tokens'][0])}.",
        "",
        f"| {name}, token 0 {_code(result['tokens'][0])}: attribution | its score "
        "| its share of the absolute scores |",
        "| --- | ---: | ---: |",
    ]
    for key, label in METHODS.items():
        share = result["token0"][key]
        lines.append(
            f"| {label.format(predicted=predicted)} | {_signed(share['token0'])} "
            f"| {_plain(share['token0_of_abs_sum'], 3)} |"
        )
    row = result["mixing_row_last_position"]
    token0, own = row["token0"], row["own"]
    top = sorted(sorted(range(len(token0)), key=lambda i: -token0[i])[:TOP_LAYERS])
    rest = [i for i in range(len(token0)) if i not in top]
    lines += [
        "",
        f"| {name}: layer | token 0's share of the last position's y | its own share |",
        "| --- | ---: | ---: |",
    ]
    lines += [f"| {i} | {_plain(token0[i])} | {_plain(own[i])} |" for i in top]
    if rest:
        lines.append(
            f"| other {len(rest)} layers: range | {_plain(min(token0[i] for i in rest))} to "
            f"{_plain(max(token0[i] for i in rest))} | {_plain(min(own[i] for i in rest))} to "
            f"{_plain(max(own[i] for i in rest))} |"
        )
    return lines


def markdown(results: list[dict[str, Any]]) -> str:
    """Committed results (one per model) as Markdown: per model, token 0's score by method
    and the last position's mixing row where token 0's share of its y is largest."""
    text = [
        "Token 0's score for the next-token prediction at the last position, by method, and "
        "the last position's mixing row (the shares of its attention block's output y that "
        "each token carries, its own residual included; they sum to 1) at the "
        f"{TOP_LAYERS} layers where token 0's share is largest.",
    ]
    for result in results:
        text += ["", *tables(result)]
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
        help="write the tables of these results (one per model) and stop",
    )  # fmt: skip
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--text", default=TEXT)
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    args = p.parse_args()
    if args.table:
        if len(args.table) < 2:
            p.error("--table takes OUT.md and at least one RESULT.json")
        return write_table(args.table[0], args.table[1:])

    import torch

    import contribution_weights as cw
    from contribution_weights.attribution.flow import forward_factors, mix
    from contribution_weights.attribution.targets import Target

    model = cw.load_model(args.model)
    pure = cw.attribute(model, args.text, quantity="flow", methods="flow", progress=False)
    logprob = cw.attribute(model, args.text, methods="flow,input_x_gradient", progress=False)
    ids = torch.tensor(pure.ids)
    last = ids.numel() - 1
    fwd, _ = forward_factors(model, ids, [Target(last, None, "flow")])
    token0, own = [], []
    for f in fwd.layers:
        assert f.rho is not None
        row = torch.zeros(1, ids.numel(), dtype=f.rho.dtype)
        row[0, last] = 1
        shares = mix("flow", f, row, fwd.block_bytes)[0]
        token0.append(float(shares[0]))
        own.append(float(shares[last]))

    def share0(scores: torch.Tensor) -> dict[str, float]:
        s = scores[0]
        return {"token0": float(s[0]), "token0_of_abs_sum": float(s[0].abs() / s.abs().sum())}

    result = {
        "model": model.name,
        "text": args.text,
        "tokens": pure.tokens,
        "predicted": pure.target_tokens[0],
        "scores": {
            "pure_flow": pure["flow"][0].tolist(),
            "flow_logprob": logprob["flow"][0].tolist(),
            "input_x_gradient": logprob["input_x_gradient"][0].tolist(),
        },
        "token0": {
            "pure_flow": share0(pure["flow"]),
            "flow_logprob": share0(logprob["flow"]),
            "input_x_gradient": share0(logprob["input_x_gradient"]),
        },
        "mixing_row_last_position": {"token0": token0, "own": own},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"attribution-first-token-{model.name}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"{model.name}: {args.text!r} -> {pure.target_tokens[0]!r}")
    for name, value in result["token0"].items():
        print(f"  token 0 ({pure.tokens[0]!r}) by {name}: {value['token0']:+.3f}")
    top = sorted(range(len(token0)), key=lambda i: -token0[i])[:4]
    print("  layers where token 0 carries most of y:", {i: round(token0[i], 3) for i in top})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
