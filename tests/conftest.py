"""Fixtures: tiny random models of every family, the real SmolLM2, evaluation data.

``fixture_data`` is the folder of made-up records under tests/fixtures/data (every clone
has it); ``shared_data`` is the real data sets beside the repository, for the few tests
that need them (they skip, saying so, where it is absent).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from jaxtyping import install_import_hook

# The tiled Triton kernels run on CPU tensors in Triton's interpreter, which must be chosen
# before anything imports triton (tests/test_tiled.py); no GPU kernel runs in the tests.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Tensor shapes in the signatures of the pure maths are checked at run time in tests
# (jaxtyping + beartype); the hook must be installed before the package is imported.
install_import_hook("contribution_weights.measures", "beartype.beartype")
sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import FAMILIES, tiny_model  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
FIXTURE_DATA = Path(__file__).parent / "fixtures" / "data"
os.environ.setdefault("CW_DATA_DIR", str(SHARED_DATA if SHARED_DATA.is_dir() else FIXTURE_DATA))
# a developer's own plugin modules must not change what the tests' `cw` commands see
os.environ.pop("CW_PLUGINS", None)


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
def fixture_data() -> Path:
    """A few made-up records in each data set's format (tests/fixtures/data)."""
    return FIXTURE_DATA


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real evaluation data beside the repository; skip without it."""
    if not SHARED_DATA.is_dir():
        pytest.skip(
            f"this test needs the real evaluation data sets at {SHARED_DATA}, which this "
            "checkout does not have (tests of the loaders use tests/fixtures/data instead)"
        )
    return SHARED_DATA


@pytest.fixture
def float64_softmax() -> Iterator[None]:
    """Llama's eager attention (which the capture path follows) takes its softmax in float32,
    and the model's sdpa path, run here for the explicit evictions, in float64; for a
    comparison at 1e-9 or finer the capture path takes it in float64 too."""
    import dataclasses

    from contribution_weights.families import FAMILIES as REGISTRY
    from contribution_weights.families import register_family

    llama = REGISTRY.get("llama")
    register_family(dataclasses.replace(llama, softmax_float32=False))
    yield
    register_family(llama)
