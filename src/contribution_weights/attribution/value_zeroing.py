"""Value zeroing (Mohebbi et al. 2023, "Quantifying Context Mixing in Transformers"),
composed over the layers as a pure flow (method §7.5).

Per layer l and token j, token j's value vectors are set to 0 in every head of layer l
alone (the attention weights are kept, nothing renormalises), the decoder layer's output
``x^(l+1)`` (residual stream and feed-forward block included) is recomputed, and

    C_ij^l = 1 − cos(x_i^(l+1), x̃_i^(l+1) | v_j = 0)   (0 for j > i),

rows normalised to sum 1. The attribution of position p is row p of ``C^(L−1) ⋯ C^0``,
carried top down as a row vector like the other flows.

Cost. One forward records every decoder layer's input and call arguments (position
embeddings, masks…); then each layer module alone is run again on a batch of copies of its
recorded input, one copy per zeroed token (``copies`` at a time), under a capture
intervention that zeroes token j's values in batch row j at that layer. So the work is
about T re-runs of every layer (T forwards' worth), not T × L forwards. Only the tokens up
to the last target are run: no later token can change an earlier position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..capture import AttentionEdit, LayerCall, capturing, check_all_layers_seen
from ..families import UnsupportedModelError
from ..loading import LoadedModel
from ..measures.layer import reciprocal
from .flow import first_tensor

#: most copies of a layer's input run in one batch
DEFAULT_COPIES = 64
#: fewer copies at long context: copies × tokens × hidden × 32 bytes (the feed-forward
#: block's activations, a float64 copy for the distances) stays under this
DEFAULT_BATCH_BYTES = 1024**3
_BYTES_PER_ELEMENT = 32


@dataclass
class _ZeroValues:
    """Capture intervention: at layer ``layer_idx``, batch row b loses token
    ``tokens[b]``'s values in every head (scale 0, no renormalisation)."""

    layer_idx: int = -1
    tokens: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def edit(self, call: LayerCall) -> AttentionEdit | None:
        if call.layer_idx != self.layer_idx:
            return None
        if call.batch != self.tokens.numel():
            raise RuntimeError(
                f"value zeroing: layer {call.layer_idx} ran on a batch of {call.batch}, "
                f"expected {self.tokens.numel()} copies"
            )
        value = call.value
        scale = torch.ones(call.batch, call.num_heads, call.k_len, dtype=value.dtype,
                           device=value.device)  # fmt: skip
        rows = torch.arange(call.batch, device=value.device)
        scale[rows, :, self.tokens.to(value.device)] = 0.0
        return AttentionEdit(scale=scale)


@dataclass
class _LayerCall:
    """One decoder layer's recorded call: its arguments and its output."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Tensor | None = None  # (T, d)

    @property
    def hidden(self) -> Tensor:  # (1, T, d)
        x = self.args[0] if self.args else self.kwargs["hidden_states"]
        assert isinstance(x, Tensor)
        return x

    def batched(self, copies: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's arguments for a batch of ``copies`` copies of its input: the hidden
        states repeated, every other tensor with a batch dimension of 1 expanded."""
        x = self.hidden.expand(copies, -1, -1).contiguous()
        kwargs = {k: _expand(v, copies) for k, v in self.kwargs.items()}
        if not self.args:
            kwargs["hidden_states"] = x
            return (), kwargs
        return (x, *(_expand(a, copies) for a in self.args[1:])), kwargs


def _expand(value: Any, copies: int) -> Any:
    """``value`` for a batch of ``copies``: tensors of two or more dimensions whose first
    (batch) dimension is 1 expanded (a view), tuples and lists element-wise."""
    if isinstance(value, Tensor):
        if value.dim() >= 2 and value.shape[0] == 1 and copies != 1:
            return value.expand(copies, *value.shape[1:])
        return value
    if isinstance(value, tuple | list):
        return type(value)(_expand(v, copies) for v in value)
    return value


@contextmanager
def _recording(layers: nn.ModuleList, calls: list[_LayerCall]) -> Iterator[None]:
    """Keep each decoder layer's arguments and output during one forward."""

    def pre(idx: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            calls[idx] = _LayerCall(tuple(args), dict(kwargs))

        return hook

    def post(idx: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
            calls[idx].output = first_tensor(out).detach()[0]

        return hook

    handles = []
    try:
        for idx, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(pre(idx), with_kwargs=True))
            handles.append(layer.register_forward_hook(post(idx), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def cosine_distance(a: Tensor, b: Tensor) -> Tensor:
    """``1 − cos(a, b)`` over the last dimension, as ``½ ‖a/‖a‖ − b/‖b‖‖²`` (equal, and
    without the cancellation of ``1 − cos`` when the two are nearly parallel), float64."""
    a, b = a.double(), b.double()
    ua = a * reciprocal(a.norm(dim=-1, keepdim=True))
    ub = b * reciprocal(b.norm(dim=-1, keepdim=True))
    return 0.5 * (ua - ub).square().sum(-1)


class ValueZeroing:
    """The recorded forward of a text and, on demand, each layer's matrix ``C^l``."""

    def __init__(
        self,
        model: LoadedModel,
        ids: Tensor,
        *,
        copies: int = DEFAULT_COPIES,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
    ) -> None:
        self.model = model
        self.layers = model.family.decoder_layers(model.model)
        self.length = int(ids.numel())
        calls: list[_LayerCall] = [_LayerCall((), {}) for _ in self.layers]
        with (
            # eager like the zeroed layer of distances(): the two outputs differ only by
            # the zeroing, not by sdpa against eager rounding
            capturing(model.model, kernel="eager") as session,
            _recording(self.layers, calls),
            torch.no_grad(),
        ):
            model.model(
                input_ids=ids[None].to(model.device), use_cache=False, **model.last_logits_only()
            )
        check_all_layers_seen(session, len(self.layers))
        for idx, call in enumerate(calls):
            if call.output is None or not (call.args or "hidden_states" in call.kwargs):
                raise UnsupportedModelError(
                    f"decoder layer {idx} was not called with its hidden states as expected; "
                    "value zeroing re-runs each layer on its recorded input"
                )
        self.calls = calls
        hidden = calls[0].hidden.shape[-1]
        per_copy = self.length * hidden * _BYTES_PER_ELEMENT
        self.copies = max(1, min(copies, batch_bytes // max(1, per_copy)))

    def distances(self, layer_idx: int) -> Tensor:
        """``(T, T)`` float64 cosine distances at layer ``layer_idx``: entry (i, j) is that of
        position i's output with token j's values zeroed from its own output; 0 for j > i."""
        call = self.calls[layer_idx]
        reference = call.output
        assert reference is not None
        stop = self.length
        out = torch.zeros(stop, stop, dtype=torch.float64, device=reference.device)
        zero = _ZeroValues(layer_idx)
        layer = self.layers[layer_idx]
        with capturing(self.model.model, intervention=zero), torch.no_grad():
            for start in range(0, stop, self.copies):
                tokens = torch.arange(start, min(stop, start + self.copies))
                zero.tokens = tokens
                args, kwargs = call.batched(tokens.numel())
                altered = first_tensor(layer(*args, **kwargs))  # (B, T, d)
                block = cosine_distance(altered, reference[None])  # (B, T)
                out[:, start : start + tokens.numel()] = block.T
        return torch.tril(out)

    def matrix(self, layer_idx: int) -> Tensor:
        """``C^l`` ``(T, T)`` float64: the distances, rows normalised to sum 1."""
        dist = self.distances(layer_idx)
        return dist * reciprocal(dist.sum(-1, keepdim=True))


def value_zeroing(
    model: LoadedModel,
    ids: Tensor,
    positions: Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    copies: int = DEFAULT_COPIES,
    progress: Callable[[int], None] | None = None,
) -> Tensor:
    """``(n, P+1)`` value-zeroing attributions of the given positions (P the last): row p
    of ``C^(L−1) ⋯ C^0``, composed top down."""
    stop = int(positions.max()) + 1
    vz = ValueZeroing(model, ids[:stop], copies=copies)
    n = int(positions.numel())
    device = model.device
    r = torch.zeros(n, stop, dtype=torch.float64, device=device)
    r[torch.arange(n, device=device), positions.to(device)] = 1.0
    for idx in range(len(vz.layers) - 1, -1, -1):
        r = r @ vz.matrix(idx).to(device)
        if progress is not None:
            progress(1)
    return r.to(dtype)
