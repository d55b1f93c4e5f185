"""Shared fixtures: tiny random models of every family, the real SmolLM2, the shared data."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from jaxtyping import install_import_hook

# Tensor shapes in the signatures of the pure maths are checked at run time in tests
# (jaxtyping + beartype); the hook must be installed before the package is imported.
install_import_hook("contribution_weights.measures", "beartype.beartype")
sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import FAMILIES, tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
os.environ.setdefault("CW_DATA_DIR", str(SHARED_DATA))


@pytest.fixture(params=FAMILIES)
def family_model(request):
    """A tiny random model, one per supported family."""
    return tiny_model(request.param)


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded default model (slow: dequantised once, then cached)."""
    import contribution_weights as cw

    return cw.load_model()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared evaluation data not found at {SHARED_DATA}")
    return SHARED_DATA
