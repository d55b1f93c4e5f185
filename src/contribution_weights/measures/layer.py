"""The per-layer quantities of method §2 as pure tensor maths.

:class:`LayerTensors` holds what one attention layer produced for a block of queries
(attention probabilities, values per KV head, the output projection) and derives every
intermediate lazily, once: head outputs, the layer output ``o_i``, the inner products
``⟨o_i, ṽ_j^(h)⟩`` and the norms ``‖ṽ_j^(h)‖``. The per-query and per-key vectors live in
its base, :class:`LayerVectors`, which the tiled kernels read without any probabilities.
Measures are small functions of those (see :mod:`.registry`).

Nothing here builds the ``(H, I, T, d)`` tensor of all weighted projected values:

* ``⟨o_i, ṽ_j^(h)⟩ = ⟨W_O^(h)ᵀ o_i, v_j⟩`` is a ``(I, d_h) · (d_h, T)`` product per head;
* ``‖ṽ_j^(h)‖² = v_jᵀ (W_O^(h)ᵀ W_O^(h)) v_j`` uses a ``d_h × d_h`` Gram matrix;
* ``⟨o_i^(h), ṽ_j^(h)⟩ = ⟨Gram_h z_i^(h), v_j⟩`` with ``z_i^(h) = Σ_j α_ij v_j``.

The distance measure (an L1 norm) is the one exception; :func:`.distance.distance`, in
its own module, walks the queries in sub-blocks so that memory stays under
``max_elements``. Products with the values run per KV head over its group of query heads
(:func:`grouped_dot`), so grouped-query layers never copy the values per query head.

Shapes: ``B`` batch, ``H`` query heads, ``G`` KV heads, ``I`` queries in the block,
``T`` keys, ``d_h`` head dim, ``d`` model dim; the signatures spell them (lower case) as
jaxtyping annotations, checked at run time under pytest (tests/conftest.py installs
jaxtyping's import hook with beartype). Where a norm in a denominator is zero the
quantity is zero (never NaN or inf) and :attr:`LayerTensors.degenerate` flags the query.
"""

# ruff: noqa: F722  (jaxtyping shape strings are not forward references)

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from jaxtyping import Bool, Float
from torch import Tensor


def safe_div(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` where ``den > 0``, else 0.

    Multiplies by the reciprocal of ``den``, which is usually a small broadcast shape
    (per query or per key): one full-size pass over ``num`` instead of a division and a
    masking pass.
    """
    return num * reciprocal(den)


def reciprocal(den: Tensor) -> Tensor:
    """``1 / den`` where ``den > 0``, else 0."""
    ok = den > 0
    return torch.where(ok, torch.where(ok, den, torch.ones_like(den)).reciprocal(), 0.0)


def grouped_product(
    left: Float[Tensor, "b h i n"], right: Float[Tensor, "b g n m"], out: Tensor | None = None
) -> Float[Tensor, "b h i m"]:
    """``(B, H, I, M)``: ``left^(h) @ right^(g(h))`` for every query head, as one product
    per KV head over its group's rows (no copy of ``right`` per query head); written into
    ``out`` (contiguous) when given."""
    b, h, i, n = left.shape
    g, m = right.shape[1], right.shape[-1]
    grouped = left.reshape(b, g, (h // g) * i, n)
    if out is not None:
        torch.matmul(grouped, right, out=out.view(b, g, (h // g) * i, m))
        return out
    return (grouped @ right).view(b, h, i, m)


def grouped_dot(
    left: Float[Tensor, "b h i dh"], values: Float[Tensor, "b g t dh"], out: Tensor | None = None
) -> Float[Tensor, "b h i t"]:
    """``(B, H, I, T)``: ``⟨left_i^(h), v_j^(g(h))⟩`` for every query head
    (:func:`grouped_product` with the values transposed)."""
    return grouped_product(left, values.transpose(-1, -2), out=out)


def value_norms(values: Float[Tensor, "b g t dh"], gram: Float[Tensor, "h dh dh"]) -> Tensor:
    """``(B, H, T)``: ‖ṽ_j^(h)‖ = sqrt(v_jᵀ Gram_h v_j) for every query head."""
    b, g, t, dh = values.shape
    h = gram.shape[0]
    vg = values[:, :, None] @ gram.view(g, h // g, dh, dh)  # (B, G, H/G, T, d_h)
    return (vg * values[:, :, None]).sum(-1).clamp_min(0).sqrt().reshape(b, h, t)


def split_output_weight(weight: Float[Tensor, "d hd"], num_heads: int) -> Float[Tensor, "h d dh"]:
    """``W_O`` of shape ``(d, H*d_h)`` as per-head blocks ``(H, d, d_h)``."""
    d, hd = weight.shape
    if hd % num_heads:
        raise ValueError(
            f"output projection input size {hd} is not a multiple of {num_heads} heads"
        )
    return weight.reshape(d, num_heads, hd // num_heads).permute(1, 0, 2)


class LayerVectors:
    """One attention layer's per-query and per-key vectors, ``O((I + T) · d)`` each, from
    its head states: what every measure reads besides the attention itself (the layer
    output ``o_i``, its norms, ``W_O^(h)ᵀ o_i / ‖o_i‖²``, ``Gram_h z_i / ‖o_i^(h)‖²``,
    ``‖ṽ_j^(h)‖``). :class:`LayerTensors` adds the attention probabilities; the tiled
    kernels (:mod:`.tiled`), which never hold them, read these vectors alone.

    Args:
        values: ``(B, G, T, d_h)`` value vectors per KV head.
        w_o: ``(H, d, d_h)`` per-head output projection blocks (:func:`split_output_weight`).
        b_o: ``(d,)`` output bias, or None.
        head_states: ``(B, H, I, d_h)`` ``z_i^(h) = Σ_j α_ij v_j`` (:class:`LayerTensors`
            derives them from the probabilities when not given).
        gram: optional precomputed ``(H, d_h, d_h)`` ``W_O^(h)ᵀ W_O^(h)``.
        value_norm: optional precomputed ``(B, H, T)`` ``‖ṽ_j^(h)‖`` (a key-side vector:
            callers that walk query blocks compute it once per layer and pass its keys).
    """

    def __init__(
        self,
        values: Float[Tensor, "b g t dh"],
        w_o: Float[Tensor, "h d dh"],
        b_o: Float[Tensor, " d"] | None,
        head_states: Float[Tensor, "b h i dh"] | None = None,
        gram: Float[Tensor, "h dh dh"] | None = None,
        value_norm: Float[Tensor, "b h t"] | None = None,
    ) -> None:
        h, g = w_o.shape[0], values.shape[1]
        if h % g:
            raise ValueError(f"{h} query heads do not divide into {g} KV heads")
        if w_o.shape[2] != values.shape[3]:
            raise ValueError(
                f"shape mismatch: values {tuple(values.shape)}, w_o {tuple(w_o.shape)}"
            )
        self.values = values
        self.w_o = w_o
        self.b_o = b_o
        if gram is not None:
            self.__dict__["gram"] = gram
        if head_states is not None:
            self.__dict__["head_states"] = head_states
        if value_norm is not None:
            self.__dict__["value_norm"] = value_norm

    # ---- intermediates ---------------------------------------------------------------
    @cached_property
    def head_values(self) -> Float[Tensor, "b h t dh"]:
        """``(B, H, T, d_h)``: v_j^(g(h)) for every query head (GQA expanded)."""
        h, g = self.w_o.shape[0], self.values.shape[1]
        return self.values.repeat_interleave(h // g, dim=1) if h != g else self.values

    @cached_property
    def gram(self) -> Float[Tensor, "h dh dh"]:
        """``(H, d_h, d_h)``: W_O^(h)ᵀ W_O^(h)."""
        return self.w_o.transpose(1, 2) @ self.w_o

    @cached_property
    def head_states(self) -> Float[Tensor, "b h i dh"]:
        """``(B, H, I, d_h)``: z_i^(h) = Σ_j α_ij v_j (head output before W_O)."""
        raise ValueError("LayerVectors needs its head states: pass head_states=")

    @cached_property
    def head_outputs(self) -> Float[Tensor, "b h i d"]:
        """``(B, H, I, d)``: o_i^(h) = W_O^(h) z_i^(h)."""
        return torch.einsum("bhid,hed->bhie", self.head_states, self.w_o)

    @cached_property
    def projected_values(self) -> Float[Tensor, "b h t d"]:
        """``(B, H, T, d)``: ṽ_j^(h) = W_O^(h) v_j (built only by measures that need it)."""
        return torch.einsum("bhtd,hed->bhte", self.head_values, self.w_o)

    @cached_property
    def output(self) -> Float[Tensor, "b i d"]:
        """``(B, I, d)``: o_i = Σ_h o_i^(h) + b_O (without building every o_i^(h))."""
        b, h, i, dh = self.head_states.shape
        flat = self.head_states.transpose(1, 2).reshape(b, i, h * dh)
        out = flat @ self.w_o_flat.T
        return out if self.b_o is None else out + self.b_o

    @cached_property
    def w_o_flat(self) -> Float[Tensor, "d hdh"]:
        """``(d, H · d_h)``: W_O itself (the heads' blocks side by side), for products that
        a per-head einsum would run as many small ones."""
        h, d, dh = self.w_o.shape
        return self.w_o.permute(1, 0, 2).reshape(d, h * dh)

    @cached_property
    def output_norm2(self) -> Float[Tensor, "b i"]:
        """``(B, I)``: ‖o_i‖²."""
        return self.output.square().sum(-1)

    @cached_property
    def output_norm(self) -> Float[Tensor, "b i"]:
        return self.output_norm2.sqrt()

    @cached_property
    def head_output_norm2(self) -> Float[Tensor, "b h i"]:
        """``(B, H, I)``: ‖o_i^(h)‖² = z Gram zᵀ."""
        return (self.head_states_gram * self.head_states).sum(-1).clamp_min(0)

    @cached_property
    def head_states_gram(self) -> Float[Tensor, "b h i dh"]:
        """``(B, H, I, d_h)``: Gram_h z_i^(h)."""
        return self.head_states @ self.gram

    @cached_property
    def value_norm(self) -> Float[Tensor, "b h t"]:
        """``(B, H, T)``: ‖ṽ_j^(h)‖ = sqrt(v_jᵀ Gram_h v_j)."""
        return value_norms(self.values, self.gram)

    @cached_property
    def scaled_back(self) -> Float[Tensor, "b h i dh"]:
        """``(B, H, I, d_h)``: W_O^(h)ᵀ o_i / ‖o_i‖² (0 where o_i = 0), so that
        ``⟨o_i, ṽ_j^(h)⟩ / ‖o_i‖² = ⟨·, v_j⟩``."""
        return self.back_projected(self.output * self.inv_output_norm2[..., None])

    def back_projected(self, x: Float[Tensor, "b i d"]) -> Float[Tensor, "b h i dh"]:
        """``(B, H, I, d_h)``: W_O^(h)ᵀ x_i for every head, as one product with W_O."""
        b, i, _ = x.shape
        h, _, dh = self.w_o.shape
        return (x @ self.w_o_flat).view(b, i, h, dh).transpose(1, 2)

    @cached_property
    def scaled_head_left(self) -> Float[Tensor, "b h i dh"]:
        """``(B, H, I, d_h)``: Gram_h z_i^(h) / ‖o_i^(h)‖² (0 where o_i^(h) = 0), so that
        ``⟨o_i^(h), ṽ_j^(h)⟩ / ‖o_i^(h)‖² = ⟨·, v_j⟩``."""
        return self.head_states_gram * reciprocal(self.head_output_norm2)[..., None]

    @cached_property
    def degenerate(self) -> Bool[Tensor, "b i"]:
        """``(B, I)`` bool: queries whose layer output is exactly zero."""
        return self.output_norm2 <= 0

    @cached_property
    def degenerate_heads(self) -> Bool[Tensor, "b h i"]:
        """``(B, H, I)`` bool: head outputs o_i^(h) that are exactly zero (č is 0 there)."""
        return self.head_output_norm2 <= 0

    @cached_property
    def zero_values(self) -> Bool[Tensor, "b h t"]:
        """``(B, H, T)`` bool: projected values ṽ_j^(h) that are exactly zero (κ is 0 there)."""
        return self.value_norm <= 0

    @cached_property
    def bias_share(self) -> Float[Tensor, "b i"]:
        """``(B, I)``: ⟨o_i, b_O⟩ / ‖o_i‖² (0 for bias-free projections)."""
        if self.b_o is None:
            return torch.zeros_like(self.output_norm2)
        return safe_div(self.output @ self.b_o, self.output_norm2)

    @cached_property
    def inv_output_norm2(self) -> Float[Tensor, "b i"]:
        """``(B, I)``: 1/‖o_i‖² (0 where o_i = 0)."""
        return reciprocal(self.output_norm2)

    @cached_property
    def inv_output_norm(self) -> Float[Tensor, "b i"]:
        """``(B, I)``: 1/‖o_i‖ (0 where o_i = 0)."""
        return reciprocal(self.output_norm)


class LayerTensors(LayerVectors):
    """One attention layer's internals for a block of queries ``rows``: its
    :class:`LayerVectors` and the attention probabilities, and the ``(B, H, I, T)``
    products the measures read.

    Args:
        probs: ``(B, H, I, T)`` attention probabilities (already zero where masked).
        values: ``(B, G, T, d_h)`` value vectors per KV head.
        w_o: ``(H, d, d_h)`` per-head output projection blocks (:func:`split_output_weight`).
        b_o: ``(d,)`` output bias, or None.
        valid: ``(B, I, T)`` bool, True where query ``i`` may attend to key ``j``.
        gram: optional precomputed ``(H, d_h, d_h)`` ``W_O^(h)ᵀ W_O^(h)`` (it depends on the
            layer only, so callers that walk query blocks pass it in).
        head_states: optional precomputed ``(B, H, I, d_h)`` ``α @ v`` (the attention
            function has it already; passing it saves one attention-sized product).
        value_norm: optional precomputed ``(B, H, T)`` ``‖ṽ_j^(h)‖`` of these keys.

    All tensors must share one floating dtype (the compute dtype) and device.
    """

    def __init__(
        self,
        probs: Float[Tensor, "b h i t"],
        values: Float[Tensor, "b g t dh"],
        w_o: Float[Tensor, "h d dh"],
        b_o: Float[Tensor, " d"] | None,
        valid: Bool[Tensor, "#b i t"],
        gram: Float[Tensor, "h dh dh"] | None = None,
        head_states: Float[Tensor, "b h i dh"] | None = None,
        value_norm: Float[Tensor, "b h t"] | None = None,
    ) -> None:
        _, h, _, t = probs.shape
        g = values.shape[1]
        if h % g:
            raise ValueError(f"{h} query heads do not divide into {g} KV heads")
        if values.shape[2] != t or w_o.shape[0] != h or w_o.shape[2] != values.shape[3]:
            raise ValueError(
                f"shape mismatch: probs {tuple(probs.shape)}, values {tuple(values.shape)}, "
                f"w_o {tuple(w_o.shape)}"
            )
        super().__init__(
            values, w_o, b_o, head_states=head_states, gram=gram, value_norm=value_norm
        )
        self.probs = probs
        self.valid = valid
        # the scores the probabilities are the softmax of, where capture kept them
        # (capture.layer.Logits: ln α = s − lse without a log pass)
        self.logits: Any = None

    @cached_property
    def head_states(self) -> Float[Tensor, "b h i dh"]:
        """``(B, H, I, d_h)``: z_i^(h) = Σ_j α_ij v_j (head output before W_O)."""
        return grouped_product(self.probs, self.values)

    @cached_property
    def output_dot_values(self) -> Float[Tensor, "b h i t"]:
        """``(B, H, I, T)``: ⟨o_i, ṽ_j^(h)⟩ = ⟨W_O^(h)ᵀ o_i, v_j⟩."""
        return grouped_dot(self.back_projected(self.output), self.values)

    @cached_property
    def output_dot_values_per_norm2(self) -> Float[Tensor, "b h i t"]:
        """``(B, H, I, T)``: ⟨o_i, ṽ_j^(h)⟩ / ‖o_i‖² (0 where o_i = 0).

        The division is folded into the ``(I, d_h)`` factor :attr:`scaled_back` before
        the product with the values, so it costs no pass over ``I × T``.
        """
        return grouped_dot(self.scaled_back, self.values)

    @cached_property
    def head_output_dot_values_per_norm2(self) -> Float[Tensor, "b h i t"]:
        """``(B, H, I, T)``: ⟨o_i^(h), ṽ_j^(h)⟩ / ‖o_i^(h)‖² = ⟨Gram_h z_i^(h), v_j⟩ / ‖o_i^(h)‖²,
        the division folded into the ``(I, d_h)`` factor :attr:`scaled_head_left` as in
        :attr:`output_dot_values_per_norm2`."""
        return grouped_dot(self.scaled_head_left, self.values)

    @cached_property
    def masked_projection(self) -> Float[Tensor, "b h i t"]:
        """:attr:`output_dot_values_per_norm2` (p) zero where the query may not attend,
        masked in place: what is read from p there is α·p, zero either way, or masked."""
        return self.masked_(self.output_dot_values_per_norm2)

    def masked(self, x: Float[Tensor, "b h i t"]) -> Float[Tensor, "b h i t"]:
        """Zero ``x`` (``(B, H, I, T)``) where the query cannot attend to the key."""
        return torch.where(self.valid[:, None], x, torch.zeros((), dtype=x.dtype, device=x.device))

    def masked_(self, x: Float[Tensor, "b h i t"]) -> Float[Tensor, "b h i t"]:
        """:meth:`masked` in place, for a tensor the caller has just created: only the
        keys some query of the block may not attend to are touched (in a causal block,
        the last few)."""
        keys = self._masked_keys
        if keys is not None:
            x[..., keys].masked_fill_(~self.valid[:, None, :, keys], 0)
        return x

    @cached_property
    def _masked_keys(self) -> slice | None:
        """The range of keys holding every pair the block masks (None: it masks none)."""
        some = (~self.valid).any(-2).any(0)  # (T,)
        if not bool(some.any()):
            return None
        t = some.shape[0]
        first = int(some.int().argmax())
        return slice(first, t - int(some.flip(0).int().argmax()))


@dataclass
class Factors:
    """What a derived measure is read from, for a block of (heads, queries, keys).

    ``maps`` holds blocks ``(…, H, I, K)`` of stored measures by name; the norms are
    shaped to broadcast against them: ``value_norm`` ``(…, H, 1, K)`` (‖ṽ_j^(h)‖),
    ``output_norm`` ``(…, 1, I, 1)`` (‖o_i‖), ``inv_output_norm`` (1/‖o_i‖, 0 where
    o_i = 0) and ``valid`` ``(…, 1, I, K)`` (where the query may attend to the key).
    """

    maps: dict[str, Tensor]
    value_norm: Tensor
    output_norm: Tensor
    valid: Tensor

    @property
    def inv_output_norm(self) -> Tensor:
        return reciprocal(self.output_norm)


# ---- the measures of method §2 (docs/method.md) --------------------------------------------
Weights = Float[Tensor, "b h i t"]  # one value per batch item, head, query and key


def attention(lt: LayerTensors, out: Tensor | None = None) -> Weights:
    return lt.probs if out is None else out.copy_(lt.probs)


def contribution(lt: LayerTensors, out: Tensor | None = None) -> Weights:
    """ĉ_ij^(h) = ⟨o_i, α_ij ṽ_j^(h)⟩ / ‖o_i‖² (written into ``out`` when given)."""
    return torch.mul(lt.probs, lt.output_dot_values_per_norm2, out=out)


def intra(lt: LayerTensors, out: Tensor | None = None) -> Weights:
    """č_ij^(h) = ⟨o_i^(h), α_ij ṽ_j^(h)⟩ / ‖o_i^(h)‖² (the product written where č goes
    and scaled there: no block of ⟨o_i^(h), ṽ_j⟩ is kept, nothing else reads one)."""
    if "head_output_dot_values_per_norm2" in lt.__dict__ or (
        out is not None and not out.is_contiguous()
    ):
        return torch.mul(lt.probs, lt.head_output_dot_values_per_norm2, out=out)
    return grouped_dot(lt.scaled_head_left, lt.values, out=out).mul_(lt.probs)


def relative_norm(lt: LayerTensors) -> Weights:
    """r_ij^(h) = ‖ṽ_j^(h)‖ / ‖o_i‖."""
    r = lt.value_norm[:, :, None, :] * lt.inv_output_norm[:, None, :, None]
    return lt.masked_(r)


def cosine(lt: LayerTensors, out: Tensor | None = None) -> Weights:
    """κ_ij^(h) = cos(o_i, ṽ_j^(h)) = (⟨o_i, ṽ_j⟩/‖o_i‖²) · ‖o_i‖ / ‖ṽ_j‖."""
    k = torch.mul(lt.output_dot_values_per_norm2, lt.output_norm[:, None, :, None], out=out)
    return lt.masked_(k.mul_(reciprocal(lt.value_norm)[:, :, None, :]))


def vw(lt: LayerTensors) -> Weights:
    """Value-weighted attention α_ij ‖ṽ_j^(h)‖ (Kobayashi et al. 2020)."""
    return lt.probs * lt.value_norm[:, :, None, :]


def vw_on(lt: LayerTensors) -> Weights:
    """Output-normalised value-weighted attention α_ij ‖ṽ_j^(h)‖ / ‖o_i‖."""
    return vw(lt).mul_(lt.inv_output_norm[:, None, :, None])


def ihc(lt: LayerTensors) -> Weights:
    """|ĉ|: the importance measure used for faithfulness."""
    return contribution(lt).abs()


def projection(lt: LayerTensors, out: Tensor | None = None) -> Weights:
    """p_ij^(h) = ⟨o_i, ṽ_j^(h)⟩ / ‖o_i‖² (= r·κ), so that ĉ = α·p and κ = p·‖o_i‖/‖ṽ_j‖;
    zero where the query may not attend to the key, like every map.

    With ``out`` the product is written there and kept as the layer's cached factor, so
    the contribution and cosine computed after it reuse it.
    """
    if out is None or "output_dot_values_per_norm2" in lt.__dict__ or not out.is_contiguous():
        p = lt.output_dot_values_per_norm2
        return lt.masked(p) if out is None else lt.masked_(out.copy_(p))
    grouped_dot(lt.scaled_back, lt.values, out=out)
    lt.__dict__["output_dot_values_per_norm2"] = lt.masked_(out)  # later keys hold 0, as α
    return out


# Derived on access, with the arithmetic of the functions above (so bit for bit equal).
def relative_norm_from(f: Factors) -> Tensor:
    r = f.value_norm * f.inv_output_norm
    return torch.where(f.valid, r, torch.zeros((), dtype=r.dtype, device=r.device))


def vw_from(f: Factors) -> Tensor:
    return f.maps["attention"] * f.value_norm


def vw_on_from(f: Factors) -> Tensor:
    return vw_from(f).mul_(f.inv_output_norm)


def contribution_from(f: Factors) -> Tensor:
    return torch.mul(f.maps["attention"], f.maps["projection"])


def cosine_from(f: Factors) -> Tensor:
    k = f.maps["projection"] * f.output_norm
    k = k.mul_(reciprocal(f.value_norm))
    return torch.where(f.valid, k, torch.zeros((), dtype=k.dtype, device=k.device))


def ihc_from(f: Factors) -> Tensor:
    return f.maps["contribution"].abs()


def ihc_from_factor(f: Factors) -> Tensor:
    return contribution_from(f).abs_()
