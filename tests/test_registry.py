"""The one registry type behind measures, KV methods, analyses and families."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from contribution_weights.registry import Registry, UnknownNameError


@dataclass(frozen=True)
class Item:
    name: str
    aliases: tuple[str, ...] = ()
    in_all: bool = True


def _registry() -> Registry[Item]:
    reg: Registry[Item] = Registry("widget", in_all=lambda item: item.in_all)
    for item in (Item("alpha", ("a",)), Item("beta"), Item("gamma", in_all=False)):
        reg.register(item)
    return reg


def test_names_all_and_comma_lists_resolve_in_the_order_given():
    reg = _registry()
    assert reg.names() == ["alpha", "beta", "gamma"]
    assert reg.resolve(None) == reg.resolve("all") == ["alpha", "beta"]
    assert reg.resolve("beta, a,alpha") == ["beta", "alpha"]  # alias resolved, deduplicated
    assert reg.resolve(["all", "gamma"]) == ["alpha", "beta", "gamma"]
    assert reg.resolve("all,gamma") == ["alpha", "beta", "gamma"]
    assert reg.get("a") is reg["alpha"] and "a" in reg and "delta" not in reg


def test_unknown_names_list_the_valid_ones_and_the_nearest_spelling():
    reg = _registry()
    with pytest.raises(UnknownNameError, match=r"unknown widget 'betta'; valid widgets: "
                       r"alpha, beta, gamma \(did you mean 'beta'\?\)"):  # fmt: skip
        reg.resolve("alpha,betta")
    # several unknown names: all of them in one message, each with its nearest spelling
    with pytest.raises(UnknownNameError, match=r"unknown widgets 'betta' \(did you mean "
                       r"'beta'\?\), 'zzz'; valid widgets: alpha, beta, gamma$"):  # fmt: skip
        reg.resolve("betta,alpha,zzz")
    with pytest.raises(ValueError, match="no widget named"):
        reg.resolve(" , ")
    assert issubclass(UnknownNameError, ValueError)  # the CLI reports ValueErrors as usage errors


def test_register_replaces_by_name_and_unregister_removes():
    reg = _registry()
    new = Item("beta", ("b",))
    assert reg.register(new) is new and reg.get("b") is new and len(reg) == 3
    assert reg.unregister("beta") is new and reg.unregister("beta") is None
    assert reg.names() == ["alpha", "gamma"]
    with pytest.raises(ValueError, match="needs a name"):
        reg.register(Item(""))


def test_custom_keys_and_plurals():
    reg: Registry[str] = Registry("family", key=str.lower, plural="families")
    reg.register("Llama")
    assert reg.names() == ["llama"]
    with pytest.raises(UnknownNameError, match="valid families: llama"):
        reg.get("gpt")


def test_every_registry_of_the_package_is_one():
    import contribution_weights as cw
    from contribution_weights.experiments import geometry
    from contribution_weights.families import FAMILIES
    from contribution_weights.kv.methods import METHODS

    for reg in (FAMILIES, METHODS, geometry.ANALYSES_REGISTRY):
        assert isinstance(reg, Registry) and len(reg) > 0
    assert sorted(FAMILIES.names()) == cw.supported_families()


def test_importing_the_registry_imports_nothing_heavy():
    code = (
        "import sys, importlib.util\n"
        "spec = importlib.util.spec_from_file_location('r', "
        f"{str(__import__('contribution_weights.registry').registry.__file__)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
