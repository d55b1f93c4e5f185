"""Model families as data: every spec against the model it describes, and unknown families."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from reference import attention_modules, output_weight
from tiny_models import tiny_model

import contribution_weights as cw
from contribution_weights import families
from contribution_weights.capture import capturing
from contribution_weights.families import FamilySpec, UnsupportedModelError, family_for

REQUIRED = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "gpt2"]
REQUIRED += ["gpt_neox", "gemma3_text"]
IDS = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])


def test_required_families_are_supported():
    assert set(REQUIRED) <= set(cw.supported_families())


def test_spec_describes_the_model(family_model):
    model = family_model.model
    spec = family_for(model.config)
    assert spec is family_model.family and spec.model_type == model.config.model_type
    layers = spec.decoder_layers(model)
    assert len(layers) == family_model.num_layers
    for idx, attn in enumerate(attention_modules(model)):
        assert any(attn is m for m in layers[idx].modules())
        weight, bias = spec.output_weight(attn)
        want_w, want_b = output_weight(model, idx)  # the reference's own table
        assert torch.equal(weight, want_w)
        assert (bias is None and want_b is None) or torch.equal(bias, want_b)
        assert weight.shape[0] == model.config.hidden_size
        assert weight.shape[1] % family_model.num_heads == 0


def test_unknown_family_lists_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as err:
        family_for(SimpleNamespace(model_type="bert"))
    message = str(err.value)
    assert "'bert'" in message and "register_family" in message
    for name in REQUIRED:
        assert name in message
    with pytest.raises(UnsupportedModelError, match="None"):
        family_for(object())


def _renamed(model_type: str) -> cw.LoadedModel:
    loaded = tiny_model("llama")
    loaded.model.config.model_type = model_type
    return loaded


def test_unknown_family_fails_before_running():
    loaded = _renamed("llama_custom_unknown")
    before = loaded.model.config._attn_implementation
    with pytest.raises(UnsupportedModelError, match="llama_custom_unknown"):
        cw.trace(loaded, IDS)
    with pytest.raises(UnsupportedModelError), capturing(loaded.model):
        pass
    assert loaded.model.config._attn_implementation == before


def test_register_family_makes_a_new_model_type_work():
    name = "llama_custom_registered"
    loaded = _renamed(name)
    expected = cw.trace(tiny_model("llama"), IDS, measures="contribution")
    try:
        spec = cw.register_family(FamilySpec(name, notes="test"))
        assert family_for(loaded.model.config) is spec
        assert name in cw.supported_families()
        got = cw.trace(loaded, IDS, measures="contribution")
        assert torch.equal(got["contribution"], expected["contribution"])
    finally:
        families.FAMILIES.unregister(name)
    assert name not in cw.supported_families()


def test_wrong_output_projection_or_layers_path_is_named():
    loaded = tiny_model("llama")
    attn = attention_modules(loaded.model)[0]
    with pytest.raises(UnsupportedModelError, match="'out_proj'"):
        FamilySpec("llama", output_projection="out_proj").output_weight(attn)
    with pytest.raises(UnsupportedModelError, match=r"transformer\.h"):
        FamilySpec("llama", layers_path="transformer.h").decoder_layers(loaded.model)
    with pytest.raises(UnsupportedModelError, match="not a ModuleList"):
        FamilySpec("llama", layers_path="model.norm").decoder_layers(loaded.model)
