"""The attribution methods, found by name (light: names and where each lives).

An :class:`AttributionMethod` names the function that computes it as ``"module:function"``
(imported on first use; ``".run:flow_method"``, with a leading dot, is a module of this
package), so the command line can list and check names without importing torch.
Register another with :func:`register_attribution_method`; its function takes
``(model, ids, targets, options)`` and returns a :class:`~.run.MethodOutput`.

Every signed method (``signed=True``, the user's too) has a magnitude twin, ``NAME_abs``
(:func:`magnitude_of`), registered with it: the same scores' absolute values, which rank a
token that pushes against the target as high as one that pushes for it (method §7.6). The
twins are not part of ``all``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..registry import Registry


@dataclass(frozen=True)
class AttributionMethod:
    """One way to attribute a prediction to input tokens.

    Attributes:
        name: what users type (``--methods NAME``).
        entry: ``"module:function"`` (or ``"module.function"``): any importable module
            (``"mymethods:scores"`` for a user's ``mymethods.py``); a leading dot
            (``".run:flow_method"``) makes it a module of this package. The function
            takes ``(model, ids, targets, options)`` and returns a
            :class:`~.run.MethodOutput`.
        description: one line for ``cw attribute --help`` and the docs.
        scalar: whether it explains a scalar target (gradient methods); pure flows
            (rollouts) explain the position's final state and ignore the token.
        cost: its cost in forward passes, for the listing.
        aliases: other accepted spellings.
        reports_logits: its output carries the logits at the target positions (its own
            forward computed them): run first, it resolves the targets for the others.
        signed: its scores have a sign (a token can push against the target):
            registering it registers its magnitude twin ``NAME_abs`` too.
        absolute_of: for a magnitude twin (``direct_abs``), the method whose scores'
            absolute values it reports; empty for a method of its own.
    """

    name: str
    entry: str
    description: str
    scalar: bool = True
    cost: str = ""
    aliases: tuple[str, ...] = ()
    reports_logits: bool = False
    signed: bool = False
    absolute_of: str = ""

    def __post_init__(self) -> None:
        if self.signed and self.absolute_of:
            raise ValueError(
                f"attribution method {self.name!r}: a magnitude twin (absolute_of="
                f"{self.absolute_of!r}) has no sign; drop signed=True"
            )


METHODS: Registry[AttributionMethod] = Registry(
    "attribution method", in_all=lambda m: not m.absolute_of
)


def register_attribution_method(method: AttributionMethod) -> AttributionMethod:
    """Add (or replace) an attribution method; a signed one brings its magnitude twin
    ``NAME_abs``, registered right after it (replacing any method of that name); a method
    replaced by an unsigned one of its name loses its twin."""
    twin = f"{method.name}_abs"
    if twin in METHODS and METHODS.get(twin).absolute_of == method.name:
        METHODS.unregister(twin)
    METHODS.register(method)
    if method.signed:
        METHODS.register(magnitude_of(method))
    return method


def magnitude_of(method: AttributionMethod) -> AttributionMethod:
    """``method``'s magnitude twin: ``NAME_abs``, its scores' absolute values (computed by
    the same function, so at the same cost; free where ``method`` has run on the input)."""
    return AttributionMethod(
        f"{method.name}_abs",
        method.entry,
        f"|{method.name}|: the magnitudes of {method.name}'s scores",
        scalar=method.scalar,
        cost=method.cost,
        reports_logits=method.reports_logits,
        absolute_of=method.name,
    )


def is_magnitude(name: str) -> bool:
    """Whether ``name`` is a registered magnitude twin (its scores carry no sign)."""
    return name in METHODS and bool(METHODS.get(name).absolute_of)


for _method in (
    AttributionMethod(
        "flow",
        ".run:flow_method",
        "contribution flow: projection shares with the residual stream, composed top down "
        "and projected on the target (method §7)",
        cost="~1.5 forwards",
        aliases=("contribution_flow",),
        signed=True,
        reports_logits=True,
    ),
    AttributionMethod(
        "direct",
        ".run:direct_method",
        "direct effects by source position: every layer's update at the target credited to "
        "the positions it read, one hop, not composed; projected on the target (method §7.6)",
        cost="flow's forward, no composition",
        aliases=("one_hop",),
        signed=True,
        reports_logits=True,
    ),
    AttributionMethod(
        "rollout",
        ".run:rollout_method",
        "attention rollout (Abnar & Zuidema 2020): head-mean attention with ½ identity, "
        "composed; a pure flow",
        scalar=False,
        cost="~1.5 forwards",
        reports_logits=True,
    ),
    AttributionMethod(
        "alti",
        ".run:alti_method",
        "ALTI-style rollout (Ferrando et al. 2022): L1-distance shares with the residual, "
        "composed; a pure flow",
        scalar=False,
        cost="O(T² d) per layer",
        reports_logits=True,
    ),
    AttributionMethod(
        "value_zeroing",
        ".run:value_zeroing_method",
        "value zeroing (Mohebbi et al. 2023): cosine distance of each layer's output when a "
        "token's values are zeroed, rows normalised, composed; a pure flow",
        scalar=False,
        cost="T re-runs of every layer",
    ),
    AttributionMethod(
        "integrated_gradients",
        ".run:integrated_gradients_method",
        "integrated gradients on the input embeddings (captum), zero baseline",
        cost="steps forwards + backwards",
        aliases=("ig",),
        signed=True,
    ),
    AttributionMethod(
        "input_x_gradient",
        ".run:input_x_gradient_method",
        "input × gradient on the input embeddings (captum)",
        cost="1 forward + backward",
        aliases=("ixg",),
        signed=True,
    ),
    AttributionMethod(
        "attnlrp",
        ".run:attnlrp_method",
        "AttnLRP (Achtibat et al. 2024): input × gradient with the backward rewritten by "
        "its rules (our implementation, checked against lxt)",
        cost="1 forward + 1 backward",
        signed=True,
    ),
    AttributionMethod(
        "feature_ablation",
        ".run:feature_ablation_method",
        "each token's embedding set to zero in turn (captum)",
        cost="T forwards",
        aliases=("ablation",),
        signed=True,
    ),
):
    register_attribution_method(_method)
