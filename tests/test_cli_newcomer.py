"""What a newcomer tripped on: index errors that say what is valid, every bad layer named,
``cw … | head`` without a traceback, progress bars readable in a log, and a command line
that answers ``--help`` and argument errors before importing torch."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap

import pytest
from tiny_models import save_tiny, tiny_model

import contribution_weights as cw
from contribution_weights.cli import CLOSED_PIPE, main
from contribution_weights.inputs import InputError, resolve_layers
from contribution_weights.progress import bar, status

TEXT = "The cat sat on the mat."


def _python(code: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(  # type: ignore[call-overload, no-any-return]
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        **kwargs,
    )


# ---- 1. an out-of-range layer or head names the valid range and the fix ------------------
@pytest.fixture(scope="module")
def last_layer_trace():
    """A trace of the tiny llama's last layer only: position 0 is model layer 1."""
    return cw.trace(tiny_model("llama"), TEXT, measures=["attention"], layers=[-1])


def test_a_layer_index_past_the_trace_names_positions_and_model_layers(last_layer_trace):
    with pytest.raises(IndexError) as err:
        last_layer_trace["attention"][1, 0]
    message = str(err.value)
    assert "layer position 1 is out of range" in message
    assert "1 traced layers, positions 0..0" in message
    assert "model's layers 1" in message  # positions vs model layer indices
    assert "model layer 1 is trace['attention'][0]" in message  # the fix
    with pytest.raises(IndexError, match=r"the model has 2 layers, 0\.\.1: it has no layer 5"):
        last_layer_trace["attention"][5]  # past the model: not worth tracing
    with pytest.raises(IndexError, match=r"positions 0\.\.0, or -1\.\.-1 from the end"):
        last_layer_trace["attention"][-2]


def test_a_layer_index_suggests_tracing_only_layers_the_model_has():
    lm = tiny_model("llama")  # 2 layers
    first = cw.trace(lm, TEXT, measures=["attention"], layers=[0])
    with pytest.raises(IndexError, match=r"model layer 1 was not traced; trace it with layers="):
        first["attention"][1]
    whole = cw.trace(lm, TEXT, measures=["attention"])
    assert whole.meta["num_layers"] == 2
    for trace in (first, whole):
        with pytest.raises(IndexError) as err:
            trace["attention"][2, 0]
        message = str(err.value)
        assert "the model has 2 layers, 0..1: it has no layer 2 to trace" in message
        assert "was not traced" not in message and "layers=[" not in message
    # without the model's layer count (maps made elsewhere) the advice stays
    made = cw.Trace.from_tensors(
        {"attention": whole["attention"].tensor()}, whole.input_ids, whole.tokens, [0, 1]
    )
    with pytest.raises(IndexError, match=r"model layer 2 was not traced; trace it with layers="):
        made["attention"][2]


def test_a_head_index_past_the_model_names_the_heads(last_layer_trace):
    with pytest.raises(IndexError) as err:
        last_layer_trace["attention"][0, 4]
    assert "head 4 is out of range" in str(err.value)
    assert "4 heads per layer, 0..3, or -4..-1 from the end" in str(err.value)
    t = last_layer_trace.num_tokens
    with pytest.raises(IndexError, match=f"query {t} is out of range: the trace holds {t} tokens"):
        last_layer_trace["attention"][0, 0, t]
    assert last_layer_trace["attention"][0, -1, -1].shape == (t,)  # in range: unchanged


# ---- 2. every bad layer is named, not the first one past the end -------------------------
def test_a_layer_range_past_the_model_names_all_bad_layers():
    with pytest.raises(InputError) as err:
        resolve_layers(list(range(41)), 30)  # --layers 0-40 on a 30-layer model
    message = str(err.value)
    assert message.startswith("layers 30..40 are out of range: the model has 30 layers")
    assert "(valid: 0..29, or -30..-1 from the end)" in message
    with pytest.raises(InputError, match=r"^layer 40 is out of range: the model has 30 layers"):
        resolve_layers([0, 40], 30)
    with pytest.raises(InputError, match=r"^layers -31, 30\.\.31, 45 are out of range"):
        resolve_layers([-31, 0, 30, 31, 45], 30)


def test_cli_layers_range_error_names_the_range(tmp_path, capsys):
    folder = save_tiny("qwen2", tmp_path / "tiny")
    args = ["trace", "--text", TEXT, "--model", str(folder), "--out", str(tmp_path / "o")]
    assert main([*args, "--layers", "0-40"]) == 2
    err = capsys.readouterr().err
    assert "layers 2..40 are out of range: the model has 2 layers (valid: 0..1" in err


# ---- 3. a reader that stops early ends the command quietly -------------------------------
@pytest.mark.parametrize(
    ("argv", "status"),
    [(["measures"], CLOSED_PIPE), (["--help"], 0)],  # argparse itself ignores the pipe
)
def test_a_closed_stdout_ends_quietly(argv, status):
    """As ``cw measures | head``: the reader has gone before anything is written (the
    deterministic form of the race), so every write fails with EPIPE."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "contribution_weights", *argv],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            timeout=120,
        )
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.stderr == ""
    assert done.returncode == status
    assert CLOSED_PIPE == 141  # 128 + SIGPIPE, as the shell reports a C program's


# ---- 4. progress written to a log is whole lines -----------------------------------------
def test_a_bar_in_a_log_writes_whole_lines_and_ends_with_a_newline():
    log = io.StringIO()  # not a terminal, like a file or a pipe
    for _ in bar(range(5), desc="trace", file=log, delay=0, mininterval=0, leave=False):
        pass
    log.write("result line\n")  # what the command prints next, into the same log
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines(keepends=True)
    assert all(line.endswith("\n") for line in lines)
    assert lines[0].startswith("trace:   0%")
    assert lines[-2].startswith("trace: 100%")  # kept although leave=False
    assert lines[-1] == "result line\n"  # on its own line, not glued to the bar


def test_a_bar_in_a_log_writes_a_line_at_most_every_interval():
    import time

    log = io.StringIO()
    with bar(total=5, desc="x", file=log, delay=0) as b:  # the default interval (30 s)
        for _ in range(5):
            time.sleep(0.12)  # past tqdm's terminal interval (0.1 s): a redraw each
            b.update()
    lines = log.getvalue().splitlines()  # (splits at carriage returns too)
    assert len(lines) == 2, lines  # the start and the end, not one per update


class _Clock:
    """tqdm's clock, moved by hand (from the real time, which tqdm's monitor also reads)."""

    def __init__(self) -> None:
        import time

        self.t = time.time()

    def __call__(self) -> float:
        return self.t


def _log_of_a_step(monkeypatch, seconds: int, *, step: float = 1.0) -> list[str]:
    """The lines a bar writes to a log over a step of ``seconds`` (default delay, interval)."""
    import tqdm.std

    clock = _Clock()
    monkeypatch.setattr(tqdm.std, "time", clock)
    monkeypatch.setattr(tqdm.std.tqdm, "monitor_interval", 0)
    log = io.StringIO()
    units = round(seconds / step)
    with bar(total=units, desc="trace", file=log, leave=False) as b:  # as a trace's bar
        for _ in range(units):
            clock.t += step
            b.update()
    text = log.getvalue()
    assert "\r" not in text and (not text or text.endswith("\n"))
    return text.splitlines()


def test_a_bar_in_a_log_shows_a_step_shorter_than_the_interval(monkeypatch):
    lines = _log_of_a_step(monkeypatch, 18)  # over the delay (2 s), under LOG_INTERVAL (30 s)
    assert len(lines) == 2, lines  # once the delay has passed, and the end
    assert lines[0].startswith("trace:  11%") and "00:02<" in lines[0]
    assert lines[1].startswith("trace: 100%") and "18/18 [00:18<" in lines[1]


def test_a_bar_in_a_log_stays_quiet_for_a_quick_step(monkeypatch):
    assert _log_of_a_step(monkeypatch, 1, step=0.25) == []  # under the delay: no line


def test_a_bar_in_a_log_of_a_long_step_writes_a_line_every_interval(monkeypatch):
    lines = _log_of_a_step(monkeypatch, 100)
    elapsed = [line.split("[")[1].split("<")[0] for line in lines]
    assert elapsed == ["00:02", "00:32", "01:02", "01:32", "01:40"], lines


def test_a_bar_on_a_terminal_still_redraws_in_place():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    for _ in bar(range(3), file=screen, delay=0, mininterval=0):
        pass
    assert "\r" in screen.getvalue()


def test_status_in_a_log_writes_whole_lines(capsys):
    import time

    with status("loading", delay=0.01):
        time.sleep(0.1)
    err = capsys.readouterr().err
    assert err.startswith("loading…\n") and err.endswith(" s\n")
    assert "\r" not in err


# ---- 5. --help and argument errors answer before torch is imported -----------------------
HEAVY = "[m for m in ('torch', 'transformers') if m in sys.modules]"


def test_building_the_parser_imports_neither_torch_nor_transformers():
    done = _python(f"""
        import sys, contribution_weights.cli as c
        p = c.build_parser()
        assert 'torch' not in sys.modules and 'transformers' not in sys.modules, {HEAVY}
        for command in ["trace", "measures", "report", "faithfulness", "downstream",
                        "geometry", "kv-eval"]:
            try:
                p.parse_args([command, "--help"])
            except SystemExit:
                pass
        assert not {HEAVY}, {HEAVY}
        """)
    assert done.returncode == 0, done.stderr


def test_argument_errors_import_neither_torch_nor_transformers(tmp_path):
    done = _python(f"""
        import sys, contribution_weights.cli as c
        for bad in (["trace", "--layers", "x"], ["trace", "--text", "a"],
                    ["faithfulness", "--rates", "x"]):
            try:
                c.main(bad)
            except SystemExit as stop:
                assert stop.code == 2, stop.code
        code = c.main(["trace", "--file", "{tmp_path}/missing.txt", "--out", "{tmp_path}/o"])
        assert code == 2, code
        assert not {HEAVY}, {HEAVY}
        """)
    assert done.returncode == 0, done.stderr
    assert "--layers: 'x' is not an index or a range" in done.stderr
    assert "the following arguments are required: --out" in done.stderr
    assert "missing.txt does not exist" in done.stderr


def test_the_package_imports_lazily_and_exports_everything():
    done = _python(f"""
        import sys
        import contribution_weights as cw
        assert not {HEAVY}, {HEAVY}
        assert set(cw.__all__) <= set(dir(cw))
        from contribution_weights import Trace, trace
        assert cw.Trace is Trace and cw.trace is trace and callable(cw.load_model)
        """)
    assert done.returncode == 0, done.stderr
    for name in cw.__all__:
        assert getattr(cw, name) is not None, name
    assert cw.tracing.trace is cw.trace and cw.measures.registry.get_measure is cw.get_measure
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        _ = cw.nope


def test_option_errors_name_the_flag_not_the_field(tmp_path, monkeypatch, capsys):
    from contribution_weights import loading
    from contribution_weights.cli import main as cw_main

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(loading, "load_model", refuse)
    out = str(tmp_path / "o")
    assert cw_main(["trace", "--text", "hi", "--max-tokens", "0", "--out", out]) == 2
    assert "cw trace: error: --max-tokens must be at least 1" in capsys.readouterr().err
    assert cw_main(["kv-eval", "--task", "passkey", "--n", "0", "--out", out]) == 2
    assert "cw kv-eval: error: --n must be at least 1" in capsys.readouterr().err
