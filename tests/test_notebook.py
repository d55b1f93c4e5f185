"""examples/quickstart.ipynb runs in a real Jupyter kernel (nbclient + ipykernel) from
this virtual environment, and its outputs are what a user should see: the trace's HTML
view, the summary table, and no errors or warnings (such as tqdm's "IProgress not found").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "examples" / "quickstart.ipynb"


def test_the_shipped_notebook_has_no_outputs():
    nb = json.loads(NOTEBOOK.read_text("utf-8"))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, "the notebook has no code cell"
    assert all(c["outputs"] == [] and c["execution_count"] is None for c in code)


def _texts(outputs: list[dict]) -> tuple[str, str]:
    """All stream/plain text of a cell's outputs, and their HTML."""
    text, html = [], []
    for out in outputs:
        if out["output_type"] == "stream":
            text.append(out["text"])
        elif out["output_type"] in ("display_data", "execute_result"):
            text.append(out["data"].get("text/plain", ""))
            html.append(out["data"].get("text/html", ""))
    return "\n".join(text), "\n".join(html)


@pytest.mark.slow
def test_quickstart_runs_and_shows_the_trace(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from jupyter_client.kernelspec import KernelSpec
    from jupyter_client.manager import KernelManager

    nb = nbformat.read(NOTEBOOK, as_version=4)
    # a last cell (only in this copy) reports which Python the kernel runs
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    km = KernelManager()
    km._kernel_spec = KernelSpec(  # the kernel is this venv's Python, whatever is installed
        argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        display_name="venv",
        language="python",
    )
    client = nbclient.NotebookClient(
        nb, km=km, timeout=600, resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()

    cells = [c for c in nb.cells if c.cell_type == "code"]
    assert Path(_texts(cells[-1].outputs)[0].strip()).parent == Path(sys.executable).parent
    for cell in cells:
        kinds = {o["output_type"] for o in cell.outputs}
        assert "error" not in kinds, cell.source
        stderr = "".join(o.get("text", "") for o in cell.outputs if o.get("name") == "stderr")
        for bad in ("IProgress not found", "Warning", "warn", "Traceback"):
            assert bad not in stderr, f"{cell.source!r} printed to stderr: {stderr}"

    sources = [c.source for c in cells]
    view = cells[next(k for k, s in enumerate(sources) if s.strip() == "trace")]
    text, html = _texts(view.outputs)
    assert '<iframe class="cw-report"' in html and "srcdoc=" in html
    assert "Trace(model='smollm2'" in text
    summary = cells[next(k for k, s in enumerate(sources) if "summary()" in s)]
    text, html = _texts(summary.outputs)
    assert "<table" in html and "contribution" in html and "first_token_weight" in html
    tokens = _texts(cells[next(k for k, s in enumerate(sources) if "cw.trace(" in s)].outputs)[0]
    assert "fox" in tokens
