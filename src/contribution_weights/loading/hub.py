"""The Hugging Face hub: answer fast when it cannot be reached (switched off, no network,
a proxy that does not answer), from the local hub cache where the model is there."""

from __future__ import annotations

import os
import re

from .model import ModelLoadError
from .sources import EMBEDDED

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_PROBE_SECONDS = 3.0


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
