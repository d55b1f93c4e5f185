"""Bad input gives errors that name the problem and the fix; models load from folders."""

from __future__ import annotations

import re

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


# ---- ids and layers ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([5, -1, 7], r"token id -1 at position 1 is negative"),
        ([5, VOCAB, 7], rf"token id {VOCAB} at position 1 is outside the vocabulary"),
        (torch.tensor([1.0, 2.5]), "whole numbers, not float32"),
    ],
)
def test_bad_ids_say_what_is_wrong(llama, ids, message):
    with pytest.raises(InputError, match=message):
        cw.trace(llama, ids, measures="attention")


def test_encode_takes_one_sequence():
    from contribution_weights.inputs import encode

    llama = tiny_model("llama")
    assert encode(llama, torch.tensor([[5, 6, 7]]), None, False).tolist() == [5, 6, 7]
    with pytest.raises(InputError, match=r"shape \(2, 2\) hold several sequences"):
        encode(llama, torch.tensor([[5, 6], [7, 8]]), None, False)


def test_empty_layer_list(llama):
    with pytest.raises(InputError, match=r"layers=\[\] names no layer.*layers=None"):
        cw.trace(llama, "abc", layers=[])
    with pytest.raises(InputError, match="not a whole number"):
        cw.trace(llama, "abc", layers=["x"])
    assert cw.trace(llama, "abc", layers=[torch.tensor(1)], measures="attention").layers == [1]
    from contribution_weights.inputs import resolve_layers

    assert resolve_layers([], 3, allow_empty=True) == []  # where "no layer" is a choice


# ---- token strings -------------------------------------------------------------------------
TEXTS = {
    "emoji": "I ❤️ 🐈 and 🇫🇷!",
    "cjk": "猫が好きです。中文也可以。",
    "rtl": "שלום עולם and مرحبا بالعالم",
}


def _byte_tokenizer():
    """A tiny byte-level BPE tokenizer without merges: one token per UTF-8 byte, so every
    character beyond ASCII is split over 2-4 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _check_token_strings(tokenizer, text):
    from contribution_weights.inputs import token_strings

    model = cw.LoadedModel(model=None, tokenizer=tokenizer, name="tokenizer only")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    strings = token_strings(model, torch.tensor(ids))
    assert len(strings) == len(ids)
    assert not any("\ufffd" in s for s in strings), strings
    # without the byte markers, the tokens spell the text exactly
    plain = "".join(re.sub(r"⟨[0-9a-f ]+⟩", "", s) for s in strings)
    assert plain == tokenizer.decode(ids) == text
    # every marker holds exactly the bytes that token leaves unfinished
    for s, i in zip(strings, ids, strict=True):
        for marker in re.findall(r"⟨([0-9a-f ]+)⟩", s):
            raw = bytes.fromhex(marker)
            assert raw and tokenizer.convert_ids_to_tokens(i)
            with pytest.raises(UnicodeDecodeError):
                raw.decode("utf-8")  # a marker is never a whole character
    return strings


@pytest.mark.parametrize("kind", list(TEXTS))
def test_token_strings_on_a_byte_level_tokenizer(kind):
    tokenizer = _byte_tokenizer()
    strings = _check_token_strings(tokenizer, TEXTS[kind])
    assert len(strings) == len(TEXTS[kind].encode())  # one token per byte
    if kind == "emoji":
        # 🐈 is f0 9f 90 88: three tokens of bytes, then the cat on the token completing it
        k = strings.index("🐈")
        assert strings[k - 3 : k] == ["⟨f0⟩", "⟨9f⟩", "⟨90⟩"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(TEXTS))
def test_token_strings_on_smollm2(kind):
    from transformers import AutoTokenizer

    from contribution_weights.loading import EMBEDDED
    from contribution_weights.loading.reading import _dequantise_to_cache

    folder = _dequantise_to_cache(EMBEDDED["smollm2"][1]())  # cached after the first load
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = tokenizer(TEXTS[kind], add_special_tokens=False)["input_ids"]
    alone = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in s for s in alone)  # decoding tokens alone loses characters here
    strings = _check_token_strings(tokenizer, TEXTS[kind])
    if kind == "cjk":
        assert "猫" in strings and "中" in strings
    if kind == "rtl":
        assert "ש" in "".join(strings) and "م" in "".join(strings)


# ---- loading: the hub without network, device_map, sizes without weights ------------------
def _no_network(monkeypatch, endpoint: str) -> None:
    import huggingface_hub.constants

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)


@pytest.mark.parametrize(
    ("endpoint", "reason"),
    [
        ("http://127.0.0.1:9", "cannot connect to 127.0.0.1:9"),  # nothing listens: refused
        ("https://hub.cw-test.invalid", r"cannot connect to hub\.cw-test\.invalid:443"),  # no DNS
    ],
)
def test_unreachable_hub_fails_within_seconds(monkeypatch, endpoint, reason):
    import time

    from contribution_weights.loading import peek_dims

    _no_network(monkeypatch, endpoint)
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match=rf"{reason}.*not in the local hub cache"):
        cw.load_model("nobody-cw-test/no-such-model")
    assert time.perf_counter() - start < 10
    assert peek_dims("nobody-cw-test/no-such-model") is None


def test_a_hub_that_does_not_answer_times_out_in_seconds(monkeypatch):
    """A black hole (packets dropped): the probe gives up after its timeout."""
    from contribution_weights import loading

    _no_network(monkeypatch, "https://huggingface.co")
    waited = []

    def black_hole(address, timeout=None, **kwargs):
        waited.append(timeout)
        raise TimeoutError("timed out")

    monkeypatch.setattr("socket.create_connection", black_hole)
    with pytest.raises(ModelLoadError, match=r"no answer from huggingface\.co:443 within 3 s"):
        cw.load_model("nobody-cw-test/no-such-model")
    assert waited == [loading.HUB_PROBE_SECONDS]


def test_hub_probe_reaches_a_listening_server(monkeypatch):
    import socket

    from contribution_weights.loading import hub_reachable

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        _no_network(monkeypatch, f"http://127.0.0.1:{server.getsockname()[1]}")
        assert hub_reachable(timeout=2) == (True, "")


def test_device_map_is_passed_to_transformers(tmp_path, monkeypatch):
    import transformers

    tiny_model("qwen3").model.save_pretrained(tmp_path)
    _char_tokenizer().save_pretrained(tmp_path)
    seen = []
    original = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs.get("device_map"))
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    loaded = cw.load_model(tmp_path, device_map="auto")
    assert seen == ["auto"] and loaded.device.type == "cpu"
    assert cw.trace(loaded, "abc", measures="attention").num_tokens == 3
    with pytest.raises(ValueError, match="device= or device_map=, not both"):
        cw.load_model(tmp_path, device="cpu", device_map="auto")


def test_peek_dims_reads_only_the_config(tmp_path):
    from contribution_weights.loading import ModelDims, peek_dims

    tiny_model("gemma2").model.save_pretrained(tmp_path)
    assert peek_dims(tmp_path) == ModelDims(num_layers=3, num_heads=4)
    assert peek_dims(tmp_path / "missing") is None
    assert peek_dims(tmp_path / "missing.gguf") is None


@pytest.mark.slow
def test_peek_dims_of_the_embedded_model(smollm2):
    from contribution_weights.loading import ModelDims, peek_dims

    # once loaded (dequantised and cached), its size is known from the config alone
    assert peek_dims(None) == peek_dims("smollm2") == ModelDims(30, 9)
    assert (smollm2.num_layers, smollm2.num_heads) == (30, 9)


def test_texts_of_length_skips_short_texts_or_joins_consecutive_ones():
    from contribution_weights.inputs import texts_of_length

    lm = tiny_model("llama")  # one token per character
    texts = ["aaaa", "bb", "  ", "cccccc", "d", "ee"]
    assert texts_of_length(lm, texts, 4) == ["aaaa", "cccccc"]
    assert texts_of_length(lm, texts, 4, n=1) == ["aaaa"]
    # joined with a blank line: "aaaa" alone reaches 4; "bb\n\ncccccc" reaches it next;
    # "d\n\nee" (5 characters) too; nothing is left over
    assert texts_of_length(lm, texts, 4, join=True) == ["aaaa", "bb\n\ncccccc", "d\n\nee"]
    assert texts_of_length(lm, texts, 9, join=True) == ["aaaa\n\nbb\n\ncccccc"]  # "d\n\nee" dropped
    with pytest.raises(InputError, match="min_tokens"):
        texts_of_length(lm, texts, 0)
