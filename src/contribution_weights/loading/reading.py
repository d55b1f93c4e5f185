"""Reading a model through transformers: a folder or hub id (:func:`_from_folder`), and a
GGUF through its dequantised cache (:func:`_from_gguf`), whose first load announces and
times each phase (:class:`LoadSteps`)."""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .sources import _cached_folder, _gguf_cache_folder, cache_dir


class LoadSteps:
    """The numbered phases of a model's first load, on stderr: each is announced when it
    starts (``contribution-weights: step 2/5: reading the tokenizer…``) and timed when it
    ends, so a load that takes minutes says what it is doing the whole time (long phases
    add transformers' own bars). ``intro`` is printed first, once."""

    PREFIX = "contribution-weights"

    def __init__(self, total: int, intro: str | None = None, *, enabled: bool = True) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        if intro and enabled:
            print(f"{self.PREFIX}: {intro}", file=sys.stderr, flush=True)

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        self.done += 1
        head = f"{self.PREFIX}: step {self.done}/{self.total}"
        if self.enabled:
            print(f"{head}: {what}…", file=sys.stderr, flush=True)
        start = time.perf_counter()
        yield
        if self.enabled:
            seconds = time.perf_counter() - start
            print(f"{head} done in {seconds:.1f} s", file=sys.stderr, flush=True)


def _first_load_intro(gguf: Path) -> str:
    return (
        f"first load of {gguf.name}: its weights are dequantised once and cached under "
        f"{cache_dir() / 'dequantised'} (SmolLM2 takes 20-40 s, Gemma 3 270M 50 s to 2 "
        "minutes on a 2-core CPU); later loads read the cache in seconds"
    )


def _dequantise_to_cache(gguf: Path, steps: LoadSteps | None = None) -> Path:
    """Dequantise a GGUF once and save it as safetensors; return the folder.

    Three phases, counted on ``steps`` (a new :class:`LoadSteps` of three when None):
    the tokenizer, the weights (transformers reads and dequantises every tensor and
    builds the model), writing the cache."""
    folder = _gguf_cache_folder(gguf)
    if (folder / "COMPLETE").exists():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if steps is None:
        steps = LoadSteps(3, _first_load_intro(gguf))
    with steps.step(f"reading the tokenizer from {gguf.name}"):
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with steps.step("reading and dequantising the weights, building the model"):
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.parent.mkdir(parents=True, exist_ok=True)
    with steps.step(f"writing the dequantised weights to {folder}"):
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
        try:
            # save_pretrained refuses models loaded through the GGUF quantizer, although the
            # weights are already plain float tensors: write config and weights ourselves.
            from safetensors.torch import save_model

            model.config.save_pretrained(tmp)
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(tmp)
            save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            tokenizer.save_pretrained(tmp)
            (tmp / "COMPLETE").write_text(str(gguf) + "\n")
            if folder.exists():
                shutil.rmtree(folder)
            tmp.rename(folder)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _from_gguf(
    gguf: Path,
    torch_dtype: torch.dtype | None,
    name: str,
    *,
    assemble: Callable[[], Path] | None = None,
    device_map: Any = None,
) -> tuple[Any, Any]:
    """A GGUF model through its dequantised cache. ``gguf`` is the file, or where
    ``assemble`` (called on a first load only) writes it."""
    folder = _cached_folder(gguf)
    if folder is not None:  # later loads: seconds, quiet
        return _from_folder(str(folder), torch_dtype, name, device_map=device_map)
    steps = LoadSteps(4 + (assemble is not None), _first_load_intro(gguf))
    if assemble is not None:
        with steps.step(f"assembling {gguf.name} from its part packages, checking its sha256"):
            gguf = assemble()
    folder = _dequantise_to_cache(gguf, steps)
    with steps.step("loading the model from the cache"):
        return _from_folder(str(folder), torch_dtype, name, device_map=device_map)


def _from_folder(
    folder: str,
    torch_dtype: torch.dtype | None,
    name: str,
    *,
    device_map: Any = None,
    local_files_only: bool = False,
) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    kwargs: dict[str, Any] = {}
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    if device_map is not None:
        kwargs["device_map"] = device_map
    if local_files_only:
        kwargs["local_files_only"] = True
    # a local folder loads in about a second: transformers' "Loading weights" bar is noise
    # there (and in notebooks); downloads from the hub keep their bars
    quiet = Path(folder).is_dir() and hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=local_files_only)
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    finally:
        if quiet:
            hf_logging.enable_progress_bar()
    return model, tokenizer
