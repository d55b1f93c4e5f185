"""Model families described as data.

Everything the capture layer needs to know about an architecture that the tensors
handed to the attention function do not already say: where the output projection
lives on the attention module and how its weight is laid out, where the decoder
layers are (for layer-input hidden states), and the family's quirks.

Queries, keys and values arrive at the registered attention function exactly as the
model uses them (after RoPE, q/k norms, biases; values per KV head), so head counts,
GQA grouping, soft-capping and sliding windows are read from those tensors and
keyword arguments, never from here.

An unknown ``model_type`` raises :class:`UnsupportedModelError`, which says what a
new entry needs. Add one with :func:`register_family`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from .registry import Registry


class UnsupportedModelError(ValueError):
    """The model's architecture has no :class:`FamilySpec`."""


@dataclass(frozen=True)
class FamilySpec:
    """How one family of Hugging Face models exposes its attention layer.

    Attributes:
        model_type: ``config.model_type`` this entry is keyed by.
        output_projection: attribute of the attention module holding the output
            projection (``o_proj``, ``c_proj``, ``dense``).
        projection_kind: ``"linear"`` (weight ``(d, H*d_h)``) or ``"conv1d"``
            (GPT-2's ``Conv1D``, weight ``(H*d_h, d)``).
        layers_path: dotted path from the causal-LM model to its list of decoder layers.
        softmax_float32: the family's eager attention takes the softmax in float32
            before casting back (all but GPT-2).
        attention: attribute of a decoder layer holding its attention module.
        attention_output_norm: attribute of a decoder layer holding a norm applied to the
            attention output before it joins the residual stream (Gemma 2 and 3), or None.
        final_norm: dotted path from the causal-LM model to the norm before the unembedding.
        notes: quirks, for the documentation.
    """

    model_type: str
    output_projection: str = "o_proj"
    projection_kind: Literal["linear", "conv1d"] = "linear"
    layers_path: str = "model.layers"
    softmax_float32: bool = True
    attention: str = "self_attn"
    attention_output_norm: str | None = None
    final_norm: str = "model.norm"
    notes: str = ""

    def output_weight(
        self, attention_module: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output projection's weight as ``(d, H*d_h)`` and its bias (or None)."""
        proj = getattr(attention_module, self.output_projection, None)
        if proj is None:
            raise UnsupportedModelError(
                f"{type(attention_module).__name__} has no attribute {self.output_projection!r}; "
                f"the FamilySpec for {self.model_type!r} names the wrong output projection."
            )
        weight = proj.weight
        if self.projection_kind == "conv1d":
            weight = weight.t()
        bias = getattr(proj, "bias", None)
        return weight, bias

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        """The model's decoder layers, in order."""
        obj = self._walk(model, self.layers_path, "layers_path")
        if not isinstance(obj, nn.ModuleList):
            raise UnsupportedModelError(f"{self.layers_path!r} is not a ModuleList")
        return obj

    def final_norm_module(self, model: nn.Module) -> nn.Module:
        """The norm applied to the last residual stream before the unembedding."""
        obj = self._walk(model, self.final_norm, "final_norm")
        if not isinstance(obj, nn.Module):
            raise UnsupportedModelError(f"{self.final_norm!r} is not a module")
        return obj

    def attention_module(self, layer: nn.Module) -> nn.Module:
        """A decoder layer's attention module."""
        obj = self._walk(layer, self.attention, "attention")
        if not isinstance(obj, nn.Module):
            raise UnsupportedModelError(f"{self.attention!r} is not a module")
        return obj

    def _walk(self, root: nn.Module, path: str, field_name: str) -> object:
        obj: object = root
        for part in path.split("."):
            if not hasattr(obj, part):
                raise UnsupportedModelError(
                    f"{type(root).__name__} has no {path!r} (stopped at {part!r}); "
                    f"fix {field_name} for {self.model_type!r}."
                )
            obj = getattr(obj, part)
        return obj


FAMILIES: Registry[FamilySpec] = Registry(
    "model family", key=lambda spec: spec.model_type, plural="model families"
)


def register_family(spec: FamilySpec) -> FamilySpec:
    """Add (or replace) the description of a model family."""
    return FAMILIES.register(spec)


for _spec in (
    FamilySpec("llama", notes="RoPE; GQA; optional attention/o_proj bias"),
    FamilySpec("mistral", notes="sliding window optional"),
    FamilySpec("qwen2", notes="q/k/v bias, no o_proj bias"),
    FamilySpec("qwen3", notes="q/k RMSNorm per head"),
    FamilySpec("gemma", notes="head_dim independent of hidden size"),
    FamilySpec(
        "gemma2",
        attention_output_norm="post_attention_layernorm",
        notes="attention logit soft-capping; alternating sliding window",
    ),
    FamilySpec(
        "gemma3",
        layers_path="model.language_model.layers",
        attention_output_norm="post_attention_layernorm",
        final_norm="model.language_model.norm",
        notes="multimodal wrapper",
    ),
    FamilySpec(
        "gemma3_text",
        attention_output_norm="post_attention_layernorm",
        notes="q/k norm; sliding window on 5 of 6 layers; GQA",
    ),
    FamilySpec("phi3", notes="fused qkv_proj"),
    FamilySpec(
        "gpt2",
        output_projection="c_proj",
        projection_kind="conv1d",
        layers_path="transformer.h",
        softmax_float32=False,
        attention="attn",
        final_norm="transformer.ln_f",
        notes="Conv1D output projection with bias; learned positions",
    ),
    FamilySpec(
        "gpt_neox",
        output_projection="dense",
        layers_path="gpt_neox.layers",
        attention="attention",
        final_norm="gpt_neox.final_layer_norm",
        notes="fused query_key_value; dense output projection with bias; partial RoPE",
    ),
):
    register_family(_spec)


def supported_families() -> list[str]:
    return sorted(FAMILIES.names())


def family_for(config: object) -> FamilySpec:
    """The spec for a transformers config, or a clear error naming what is missing."""
    model_type = getattr(config, "model_type", None)
    if isinstance(model_type, str) and model_type in FAMILIES:
        return FAMILIES.get(model_type)
    raise UnsupportedModelError(
        f"architecture {model_type!r} is not supported. Supported model types: "
        f"{', '.join(supported_families())}. To add it, call "
        "contribution_weights.register_family(FamilySpec(model_type=..., output_projection=..., "
        "projection_kind=..., layers_path=...)) naming the attention module's output "
        "projection and where the decoder layers are; its attention must go through "
        "transformers' AttentionInterface."
    )
