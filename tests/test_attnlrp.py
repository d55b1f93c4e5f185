"""AttnLRP (attribution/attnlrp.py) on tiny float64 models.

* On a tiny Llama the scores equal a hand-written forward with the rules applied by
  explicit detach tricks (no hooks, no attention function of ours).
* On every family the scores satisfy AttnLRP's conservation exactly as the rules imply:
  ``Σ_j R_j = f₀ − Σ bias·g − Σ position-embedding·g − Σ softmax leaks`` (module docstring),
  with ``f₀`` the value the backward starts from; and the logits it computes are the model's.
* The model is given back unchanged: bit-identical logits, no hooks, the same attention
  implementation and train/eval flag, no ``.grad``.
* ``cw attribute --methods attnlrp`` runs end to end.
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from contribution_weights import LoadedModel
from contribution_weights.attribution.attnlrp import _logits, attnlrp, attnlrp_rules
from contribution_weights.attribution.gradients import _embeds, input_x_gradient
from contribution_weights.attribution.targets import Target, resolve

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import FAMILIES, save_tiny, tiny_model

T = 9


@cache
def model_of(family: str) -> LoadedModel:
    return tiny_model(family, dtype=torch.float64)


def ids_of(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 99, (T,), generator=torch.Generator().manual_seed(seed))


def full_logits(model: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.model(input_ids=ids[None], use_cache=False).logits[0]


def targets_of(model: LoadedModel, ids: torch.Tensor) -> list[Target]:
    raw = [Target(T - 1), Target(4, None, "logit"), Target(6, 3, "contrast", foil=11)]
    return resolve(raw, full_logits(model, ids)[[t.position for t in raw]])


def start_value(logits: torch.Tensor, t: Target) -> float:
    """The value the backward starts from (logprob: its linear part, P held fixed)."""
    row = logits[t.position]
    assert t.token is not None
    if t.quantity == "logit":
        return float(row[t.token])
    if t.quantity == "contrast":
        assert t.foil is not None
        return float(row[t.token] - row[t.foil])
    return float(row[t.token] - (row.softmax(-1) * row).sum())


def reference_llama(model: LoadedModel, ids: torch.Tensor, t: Target) -> torch.Tensor:
    """AttnLRP on a Llama written out by hand: norms with the rms detached, SiLU by the
    identity rule (``x · (silu(x)/x)``, the ratio detached), ``c·x + ((1−c)·x).detach()``
    for the uniform rule's gradient scaling, eager causal attention, plain softmax."""
    lm = model.model
    cfg = lm.config
    m = lm.model
    e = m.embed_tokens(ids[None]).detach().requires_grad_(True)
    heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cos, sin = m.rotary_emb(e, torch.arange(T)[None])
    cos, sin = cos[:, None], sin[:, None]

    def norm(x, mod):
        rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + mod.variance_epsilon)
        return mod.weight * (x * rms.detach())

    def grad_times(x, c):
        return c * x + ((1 - c) * x).detach()

    def rope(x):
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    causal = torch.full((T, T), float("-inf"), dtype=e.dtype).triu(1)
    h = e
    for layer in m.layers:
        a = layer.self_attn
        x = norm(h, layer.input_layernorm)
        q = rope(a.q_proj(x).view(1, T, heads, hd).transpose(1, 2))
        k = rope(a.k_proj(x).view(1, T, kv, hd).transpose(1, 2))
        v = a.v_proj(x).view(1, T, kv, hd).transpose(1, 2)
        q, k, v = grad_times(q, 0.25), grad_times(k, 0.25), grad_times(v, 0.5)
        k = k.repeat_interleave(heads // kv, 1)
        v = v.repeat_interleave(heads // kv, 1)
        p = (q @ k.transpose(-1, -2) * hd**-0.5 + causal).softmax(-1)
        h = h + a.o_proj((p @ v).transpose(1, 2).reshape(1, T, heads * hd))
        x = norm(h, layer.post_attention_layernorm)
        pre = layer.mlp.gate_proj(x)
        gate = pre * (F.silu(pre) / pre).detach()
        h = h + layer.mlp.down_proj(grad_times(gate * layer.mlp.up_proj(x), 0.5))
    logits = lm.lm_head(norm(h, m.norm))[0, t.position]
    value = torch.log_softmax(logits, -1)[t.token]
    (grad,) = torch.autograd.grad(value, e)
    return (e * grad)[0].sum(-1).detach()


def test_llama_matches_a_hand_written_attnlrp():
    model = model_of("llama")
    assert model.model.config.attention_bias  # q/k/v/o biases on: their paths are covered
    ids = ids_of()
    (target,) = targets_of(model, ids)[:1]
    assert target.quantity == "logprob"
    ours = attnlrp(model, ids, [target])[0]
    ref = reference_llama(model, ids, target)
    # the target's own token dominates; the earlier tokens are checked on their own scale
    for part in (slice(None), slice(0, T - 1)):
        scale = float(ref[part].abs().max())
        assert float((ours - ref)[part].abs().max()) <= 1e-5 * scale
    # the rules matter: plain input x gradient is far from it
    plain = input_x_gradient(model, ids, [target])[0]
    assert float((plain - ref)[: T - 1].abs().max()) > 0.2 * scale


@pytest.mark.parametrize("family", FAMILIES)
def test_conservation_and_the_models_own_logits(family):
    """Σ R + leaks = f₀ to rounding (the model's norms compute in float32, so 1e-6); the
    leaks are not negligible, so the identity is not the trivial Σ R = f₀."""
    model = model_of(family)
    ids = ids_of()
    logits = full_logits(model, ids)
    with torch.no_grad(), attnlrp_rules(model.model):
        ours = _logits(model.model, _embeds(model, ids), 0)[0]
    assert float((ours - logits).abs().max()) <= 1e-6 * (1 + float(logits.abs().max()))
    targets = targets_of(model, ids)
    audit: list[list[torch.Tensor]] = []
    scores = attnlrp(model, ids, targets, audit=audit)
    assert scores.shape == (len(targets), T) and scores.dtype == torch.float64
    for k, t in enumerate(targets):
        f0 = start_value(logits, t)
        leaks = float(sum(audit[k]))
        total = float(scores[k].sum())
        assert abs(total + leaks - f0) <= 1e-6 * (1 + abs(f0)), (t, total, leaks, f0)
        assert abs(leaks) > 1e-4  # every family has a softmax (and most a bias) that leaks
        # a causal model: tokens after the target get nothing
        assert torch.all(scores[k, t.position + 1 :] == 0)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_the_model_is_given_back_unchanged(family):
    model = tiny_model(family, dtype=torch.float64)
    lm = model.model
    ids = ids_of(2)
    implementation = lm.config._attn_implementation
    before = full_logits(model, ids)
    lm.train()
    attnlrp(model, ids, targets_of(model, ids))
    assert lm.training  # its mode restored (eval inside)
    lm.eval()
    assert torch.equal(full_logits(model, ids), before)
    assert lm.config._attn_implementation == implementation
    for module in lm.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    assert all(p.grad is None for p in lm.parameters())


def test_no_targets_and_the_sum_over_a_continuation():
    model = model_of("qwen3")
    ids = ids_of(3)
    assert attnlrp(model, ids, []).shape == (0, T)
    targets = resolve(
        [Target(5, 4, "logit"), Target(8, 2, "logit")], full_logits(model, ids)[[5, 8]]
    )
    both = attnlrp(model, ids, targets)
    for k, t in enumerate(targets):  # one forward shared: the same as one target at a time
        assert torch.allclose(both[k], attnlrp(model, ids, [t])[0], rtol=0, atol=1e-12)


def test_cw_attribute_runs_attnlrp(tmp_path, capsys):
    from contribution_weights.attribution.result import Attribution
    from contribution_weights.cli import main

    folder = save_tiny("llama", tmp_path / "tiny")
    out = tmp_path / "a"
    code = main(["attribute", "--text", "abcabcab", "--model", str(folder), "--methods",
                 "attnlrp,attnlrp_abs", "--out", str(out)])  # fmt: skip
    assert code == 0
    assert "attnlrp" in capsys.readouterr().out
    loaded = Attribution.load(out)
    assert loaded.methods == ["attnlrp", "attnlrp_abs"]
    scores = loaded["attnlrp"]
    assert scores.shape == (1, len(loaded.tokens)) and torch.isfinite(torch.as_tensor(scores)).all()
    assert torch.equal(torch.as_tensor(loaded["attnlrp_abs"]), torch.as_tensor(scores).abs())
