"""Each way of removing a token from a head, against an explicit eager computation in
float64 on tiny models: the attention output of the edited layer (the output projection's
input) from the model's own eager probabilities and values, edited by hand."""

from __future__ import annotations

import pytest
import torch
from reference import attention_modules, eager_logits, eager_run, layout, output_projection
from tiny_models import tiny_model

from contribution_weights.capture import AttentionEdit, capturing
from contribution_weights.interventions import CLEAN, Removal, SequentialRemoval
from contribution_weights.kv import cache_keyword

LAYER = 1  # edited; layer 0 runs clean, so layer 1's inputs are the eager run's
T = 12


class FixedEdit:
    """An edit of one layer: the keys in ``removed`` ``(B, H, T)`` leave as ``how`` says."""

    def __init__(self, removed: torch.Tensor, how: str):
        self.removed, self.how = removed, how

    def edit(self, call):
        if call.layer_idx != LAYER:
            return None
        if self.how == "key_mask":
            return AttentionEdit(masked=self.removed)
        if self.how == "mean_value":
            return AttentionEdit(replaced=self.removed)
        return AttentionEdit(scale=(~self.removed).to(call.query.dtype))


def _projection_input(model, ids, intervention) -> torch.Tensor:
    """``(B, T, H·d_h)``: what layer ``LAYER``'s output projection receives."""
    seen = {}

    def grab(_module, args):
        seen["x"] = args[0].detach()

    handle = output_projection(model, LAYER).register_forward_pre_hook(grab)
    try:
        with torch.no_grad(), capturing(model, intervention=intervention):
            model(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    return seen["x"]


def _reference(model, ids, removed, how) -> torch.Tensor:
    """The edit by hand from the eager run's probabilities and values of layer LAYER."""
    run = eager_run(model, ids)
    probs = run.probs[LAYER].double()  # (B, H, T, T)
    values = run.values[LAYER].double()  # (B, G, T, d_h)
    h = probs.shape[1]
    values = values.repeat_interleave(h // values.shape[1], dim=1)  # (B, H, T, d_h)
    gone = removed[:, :, None, :]  # (B, H, 1, T)
    if how == "key_mask":  # softmax over the keys left: the token is not in the cache
        kept = probs.masked_fill(gone, 0.0)
        lost = (probs * gone).sum(-1, keepdim=True) > 0  # a row that lost nothing is as it was
        out = torch.where(lost, kept / kept.sum(-1, keepdim=True), probs) @ values
    elif how == "mean_value":  # its value becomes the mean of the values the query sees
        visible = (probs > 0).double()  # where each query may attend (eager's own mask)
        mean = (visible / visible.sum(-1, keepdim=True)) @ values
        out = probs.masked_fill(gone, 0.0) @ values + (probs * gone).sum(-1, keepdim=True) * mean
    else:  # value_zero: the paper's removal, no renormalisation
        out = probs.masked_fill(gone, 0.0) @ values
    b, _, t, d = out.shape
    return out.transpose(1, 2).reshape(b, t, h * d)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("how", ["value_zero", "key_mask", "mean_value"])
def test_each_intervention_is_its_explicit_computation(family: str, how: str) -> None:
    model = tiny_model(family, dtype=torch.float64).model
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 99, (2, T), generator=gen)
    h = model.config.num_attention_heads
    removed = torch.rand(2, h, T, generator=gen) < 0.3
    removed[:, :, 0] = False  # every query keeps a key
    got = _projection_input(model, ids, FixedEdit(removed, how))
    want = _reference(model, ids, removed, how)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    clean = _projection_input(model, ids, FixedEdit(torch.zeros_like(removed), how))
    assert (got - clean).abs().max() > 1e-4  # the edit changed something: the test can fail


def test_the_three_interventions_differ_and_clean_rows_are_untouched() -> None:
    lm = tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(0, 99, (1, T), generator=torch.Generator().manual_seed(3))
    rows = [CLEAN, Removal("attention", "comprehensiveness", 0.5)]
    logits = {}
    for how in ("value_zero", "key_mask", "mean_value"):
        probe = SequentialRemoval(rows, how=how)
        with torch.no_grad(), capturing(lm.model, intervention=probe):
            logits[how] = lm.model(input_ids=ids.expand(2, -1), use_cache=False).logits
    # the clean row is the plain model's (to the float32 rounding of eager's softmax, which
    # a batch of 2 instead of 1 can move by one bit), and the three clean rows are identical
    plain = eager_logits(lm.model, ids)[0]
    for how, out in logits.items():
        torch.testing.assert_close(out[0], plain, rtol=1e-6, atol=1e-6)
        assert torch.equal(out[0], logits["value_zero"][0]), how
        assert (out[1] - plain).abs().max() > 1e-4, how
    assert (logits["key_mask"][1] - logits["value_zero"][1]).abs().max() > 1e-4
    assert (logits["mean_value"][1] - logits["value_zero"][1]).abs().max() > 1e-4
    with pytest.raises(ValueError, match="unknown intervention 'zero'"):
        SequentialRemoval(rows, how="zero")


def test_reference_layout_is_the_projection_input() -> None:
    """The hand-built reference reads the right tensors: without an edit it equals what the
    output projection receives (guards the reference itself)."""
    model = tiny_model("qwen2", dtype=torch.float64).model
    ids = torch.randint(0, 99, (1, T), generator=torch.Generator().manual_seed(5))
    none = torch.zeros(1, model.config.num_attention_heads, T, dtype=torch.bool)
    got = _projection_input(model, ids, FixedEdit(none, "key_mask"))
    torch.testing.assert_close(got, _reference(model, ids, none, "value_zero"))
    assert attention_modules(model) and layout(model.config.model_type)


def test_observers_never_see_alpha_v_that_a_replacement_changed() -> None:
    """Under mean_value the layer's output is not α·v of the probabilities shown, so the
    shared view must not hand it to observers as the block's α·v."""
    seen = []

    class Recorder:
        def observe(self, view):
            seen.append(view.states is None)

    model = tiny_model("llama", dtype=torch.float64).model
    ids = torch.randint(0, 99, (1, T), generator=torch.Generator().manual_seed(9))
    removed = torch.zeros(1, model.config.num_attention_heads, T, dtype=torch.bool)
    removed[:, :, 3] = True
    for how, expect_none in (("mean_value", True), ("value_zero", False)):
        seen.clear()
        with torch.no_grad(), capturing(model, [Recorder()], intervention=FixedEdit(removed, how)):
            model(input_ids=ids, use_cache=False)
        layer_one = seen[1]  # layer 0 runs unedited; layer 1 is edited
        assert layer_one is expect_none, how


class EveryLayer:
    """``key_mask`` of the same tokens in every head of every layer."""

    def __init__(self, gone: list[int], heads: int, t: int):
        self.removed = torch.zeros(1, heads, t, dtype=torch.bool)
        self.removed[:, :, gone] = True

    def edit(self, call):
        return AttentionEdit(masked=self.removed)


def _decode_deleting(model, ids: torch.Tensor, gone: list[int]) -> torch.Tensor:
    """``(T, V)`` logits of a token-by-token decode (the model's sdpa attention, which
    keeps float64 throughout; eager's softmax rounds to float32) that deletes each token of
    ``gone`` from every layer's cache once it has been fed (its keys and values are then
    in no later query's cache); positions stay the original ones."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = []
    for pos in range(ids.shape[1]):
        length = cache.get_seq_length()
        step = model(
            input_ids=ids[:, pos : pos + 1],
            position_ids=torch.tensor([[pos]]),
            cache_position=torch.tensor([length]),
            **{cache_keyword(model): cache},
            use_cache=True,
        )
        out.append(step.logits[0, -1])
        if pos in gone:  # the token just fed is the cache's last entry in every layer
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[:, :, :-1], layer.values[:, :, :-1]
    return torch.stack(out)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_key_mask_equals_deleting_the_tokens_from_the_cache(family: str) -> None:
    """Masking a token's key in every head and layer is the token evicted from the cache:
    every other position's logits equal an explicit decode whose cache loses the token's
    keys and values right after it is fed (float64 weights)."""
    model = tiny_model(family, dtype=torch.float64).model
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 99, (1, T), generator=torch.Generator().manual_seed(11))
    gone = [2, 5, 6, 9]
    probe = EveryLayer(gone, model.config.num_attention_heads, T)
    with torch.no_grad():
        with capturing(model, intervention=probe):
            masked = model(input_ids=ids, use_cache=False).logits[0]
        deleted = _decode_deleting(model, ids, gone)
        plain = _decode_deleting(model, ids, [])
        whole = model(input_ids=ids, use_cache=False).logits[0]
    others = [p for p in range(T) if p not in gone]
    # the capture's softmax rounds to float32 as these families' eager attention does
    # (differences up to ~4e-8 here), five orders below what the deletion changes (>= 5e-3)
    torch.testing.assert_close(masked[others], deleted[others], rtol=1e-6, atol=1e-7)
    # the decode itself is the model's forward, and the deletion changed what follows it
    torch.testing.assert_close(plain, whole, rtol=1e-10, atol=1e-10)
    assert (deleted[gone[0] + 1 :] - plain[gone[0] + 1 :]).abs().max() > 1e-3
