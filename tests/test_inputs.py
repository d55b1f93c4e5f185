"""Bad input gives errors that name the problem and the fix; models load from folders."""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, tiny_model

import contribution_weights as cw
from contribution_weights import InputError, ModelLoadError


@pytest.fixture(scope="module")
def llama() -> cw.LoadedModel:
    return tiny_model("llama")  # max_position_embeddings 128, 2 layers


@pytest.mark.parametrize("text", ["", "   \n\t"])
def test_empty_text(llama, text):
    with pytest.raises(InputError, match="text is empty"):
        cw.trace(llama, text)


def test_empty_ids(llama):
    with pytest.raises(InputError, match="no tokens"):
        cw.trace(llama, [])


def test_text_longer_than_the_context(llama):
    text = "abcdefghij" * 13  # 130 tokens > 128
    with pytest.raises(InputError, match=r"130 tokens, more than 128.*truncate=True"):
        cw.trace(llama, text, measures="attention")
    tr = cw.trace(llama, text, measures="attention", truncate=True, layers=[0])
    assert tr.num_tokens == 128 and tr["attention"].shape == (1, 4, 128, 128)
    assert tr.input_ids.tolist() == [ord(c) % VOCAB for c in text[:128]]


def test_max_tokens(llama):
    with pytest.raises(InputError, match=r"more than 5 \(--max-tokens\)"):
        cw.trace(llama, "abcdefgh", max_tokens=5)
    tr = cw.trace(llama, "abcdefgh", max_tokens=5, truncate=True, measures="vw")
    assert tr.num_tokens == 5 and tr["vw"].shape[-1] == 5


def test_unknown_measure_lists_the_valid_ones(llama):
    with pytest.raises(ValueError, match="unknown measure 'contrib'") as err:
        cw.trace(llama, "abc", measures=["attention", "contrib"])
    for name in cw.measure_names():
        assert name in str(err.value)


@pytest.mark.parametrize("layer", [2, -3, 100])
def test_layer_out_of_range(llama, layer):
    with pytest.raises(InputError, match=r"out of range: the model has 2 layers \(valid: 0\.\.1"):
        cw.trace(llama, "abc", layers=[layer])


def test_negative_and_repeated_layers(llama):
    tr = cw.trace(llama, "abc", layers=[-1, 1, 0], measures="attention")
    assert tr.layers == [0, 1]


def test_bad_compute_dtype_and_model(llama):
    with pytest.raises(InputError, match="float32 or float64"):
        cw.trace(llama, "abc", compute_dtype="float16")
    with pytest.raises(TypeError, match="LoadedModel"):
        cw.trace(llama.model, "abc")


def test_list_of_texts(llama):
    traces = cw.trace(llama, ["ab", "cde"], measures="attention")
    assert [t.num_tokens for t in traces] == [2, 3]


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        cw.load_model(str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        cw.load_model(tmp_path / "model.gguf")
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        cw.load_model(tmp_path)
    with pytest.raises(ValueError, match="unknown dtype"):
        cw.load_model(tmp_path, dtype="int8")


def test_unreachable_hub_id(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="Hub ids need network access"):
        cw.load_model("nobody-cw-test/no-such-model")


def _char_tokenizer():
    """A real (saveable) fast tokenizer: one token per printable character."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(32 + i): i for i in range(95)} | {"<unk>": 95}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_saved_folder_loads_and_traces_the_same(tmp_path):
    original = tiny_model("qwen3")
    original.model.save_pretrained(tmp_path)
    _char_tokenizer().save_pretrained(tmp_path)
    loaded = cw.load_model(tmp_path)
    assert loaded.config.model_type == "qwen3" and not loaded.model.training
    ids = loaded.tokenizer("Hello, world")["input_ids"]
    assert len(ids) == 12
    got = cw.trace(loaded, "Hello, world", measures="contribution")
    want = cw.trace(original, ids, measures="contribution")
    torch.testing.assert_close(got["contribution"].tensor(), want["contribution"].tensor())
    half = cw.load_model(tmp_path, dtype="bfloat16")
    assert half.model.dtype == torch.bfloat16
