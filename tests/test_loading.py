"""A GGUF's first load says what it is doing in every phase; later loads are quiet.

Reading a real GGUF takes tens of seconds, so transformers' two GGUF readers (tokenizer,
weights) are replaced by ones that return a tiny random model and a char tokenizer; the
rest (writing the safetensors cache, loading from it) runs for real.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers as tf
from tiny_models import char_tokenizer_fast, tiny_model

import contribution_weights as cw
from contribution_weights import loading


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A file named model.gguf whose "reading" gives a tiny llama; the cache in tmp_path."""
    monkeypatch.setenv("CW_CACHE_DIR", str(tmp_path / "cache"))
    lm = tiny_model("llama")
    lm.model.config.tokenizer_class = "TokenizersBackend"  # the saved char tokenizer
    reads: list[str] = []

    def patch(cls, make):
        original = cls.from_pretrained

        def from_pretrained(name, *args, **kwargs):
            if kwargs.get("gguf_file"):
                reads.append(cls.__name__)
                return make()
            return original(name, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", from_pretrained)

    patch(tf.AutoTokenizer, char_tokenizer_fast)
    patch(tf.AutoModelForCausalLM, lambda: lm.model)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF not really")
    return gguf, lm, reads


def _steps(err: str) -> list[str]:
    return re.findall(r"step (\d+/\d+)(:| done)", err)


def test_first_load_announces_and_times_every_phase_later_loads_are_quiet(fake_gguf, capsys):
    gguf, lm, reads = fake_gguf
    model = cw.load_model(gguf)
    err = capsys.readouterr().err
    assert "first load of model.gguf" in err and "later loads read the cache" in err
    for k, what in enumerate(
        ["reading the tokenizer", "reading and dequantising the weights", "writing the "
         "dequantised weights", "loading the model from the cache"], 1,
    ):  # fmt: skip
        assert f"step {k}/4: {what}" in err
        assert re.search(rf"step {k}/4 done in \d+\.\d s", err)
    # each phase is announced before it runs and timed when it ends, in order
    assert _steps(err) == [(f"{k}/4", s) for k in range(1, 5) for s in (":", " done")]
    assert reads == ["AutoTokenizer", "AutoModelForCausalLM"]
    for a, b in zip(model.model.parameters(), lm.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)

    again = cw.load_model(gguf)  # from the cache: no GGUF read, no step lines
    assert reads == ["AutoTokenizer", "AutoModelForCausalLM"]
    assert "step" not in capsys.readouterr().err
    assert again.num_layers == lm.num_layers


def test_a_model_assembled_from_parts_counts_that_phase_too(fake_gguf, tmp_path, capsys):
    gguf, _, _ = fake_gguf
    target = tmp_path / "assembled" / "model.gguf"

    def assemble():
        target.parent.mkdir()
        target.write_bytes(gguf.read_bytes())
        return target

    loading._from_gguf(target, None, "parts", assemble=assemble)
    err = capsys.readouterr().err
    assert "step 1/5: assembling model.gguf from its part packages" in err
    assert "step 5/5: loading the model from the cache" in err
    assert len(_steps(err)) == 10
    called = []
    loading._from_gguf(target, None, "parts", assemble=lambda: called.append(1) or target)
    assert not called and "step" not in capsys.readouterr().err  # cached: not reassembled


def test_load_steps_can_be_silenced(capsys):
    steps = loading.LoadSteps(2, "intro", enabled=False)
    with steps.step("a"):
        pass
    with steps.step("b"):
        pass
    assert capsys.readouterr().err == "" and steps.done == 2


@pytest.mark.parametrize(
    ("device", "message"),
    [("gpu", "is not a device"), ("cuda", "CUDA"), ("cuda:7", "CUDA")],
)
def test_a_device_this_machine_lacks_is_refused_before_loading(device, message, monkeypatch):
    import torch

    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has the devices")

    def refuse(*a, **k):
        raise AssertionError("weights were read before the device was checked")

    monkeypatch.setattr(loading, "_from_gguf", refuse)
    monkeypatch.setattr(loading, "_from_folder", refuse)
    with pytest.raises(loading.ModelLoadError, match=message):
        loading.load_model(device=device)


def test_a_bad_device_is_one_line_from_the_cli(tmp_path, capsys):
    from contribution_weights.cli import main

    out = str(tmp_path / "o")
    assert main(["trace", "--text", "hi", "--device", "gpu", "--out", out]) == 2
    assert "'gpu' is not a device" in capsys.readouterr().err
