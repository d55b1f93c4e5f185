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
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TEXT = "The capital of France is Paris. The capital of Germany is"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--text", default=TEXT)
    p.add_argument("--out", type=Path, default=Path("bench-out"))
    args = p.parse_args()

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
