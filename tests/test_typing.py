"""``cw.trace`` is precisely typed: one text gives a Trace, a list of texts a list."""

from __future__ import annotations

import pytest


@pytest.mark.slow  # runs mypy over the package (about half a minute cold)
def test_trace_overloads(tmp_path):
    api = pytest.importorskip("mypy.api")
    snippet = tmp_path / "use.py"
    snippet.write_text(
        "import contribution_weights as cw\n"
        "from typing import reveal_type\n"
        "m = cw.load_model()\n"
        "reveal_type(cw.trace(m, 'a text'))\n"
        "reveal_type(cw.trace(m, ['a', 'b']))\n"
        "reveal_type(cw.trace(m, [1, 2, 3]))\n"
    )
    out, _, _ = api.run([str(snippet), "--cache-dir", str(tmp_path / "cache")])
    revealed = [line.split('"')[1] for line in out.splitlines() if "Revealed type" in line]
    trace = "contribution_weights.tracing.result.Trace"
    assert revealed == [trace, f"list[{trace}]", trace], out
