"""Trace folders that cannot be silently wrong: one writer at a time, written in a staging
folder and moved into place when complete, every file checked against its checksum."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny, tiny_model

import contribution_weights as cw
from contribution_weights.cli import main
from contribution_weights.tracing import folder as folder_mod
from contribution_weights.tracing.folder import TraceFileError, TraceFolderBusy, verify

TESTS = Path(__file__).parent
SRC = TESTS.parent / "src"
IDS_A = torch.tensor([5, 17, 3, 88, 42, 9, 61, 23, 7, 70, 11, 2])
IDS_B = torch.tensor([40, 33, 8, 95, 14, 6, 50, 21, 19, 4])


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama")


def _flip(path: Path, offset_from_end: int = 1) -> None:
    raw = bytearray(path.read_bytes())
    raw[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(raw))


def _same_trace(folder: Path, ids: torch.Tensor) -> None:
    loaded = cw.Trace.load(folder, verify=True)
    assert loaded.input_ids.tolist() == ids.tolist()
    assert verify(folder) == []


def test_checksums_cover_every_file_and_verify_passes(lm, tmp_path, capsys):
    cw.trace(lm, IDS_A, out=tmp_path, measures="attention,contribution")
    sums = json.loads((tmp_path / "meta.json").read_text())["checksums"]
    shards = sorted(f"maps/{p.name}" for p in (tmp_path / "maps").iterdir())
    assert len(shards) == lm.num_layers
    expected = {*shards, "vectors.safetensors", "tokens.json", "summary.json"}
    assert expected <= set(sums)
    assert all(v.startswith("sha256:") and len(v) == 7 + 64 for v in sums.values())
    import hashlib

    digest = hashlib.sha256((tmp_path / shards[0]).read_bytes()).hexdigest()
    assert sums[shards[0]] == f"sha256:{digest}"  # what sha256sum prints
    assert verify(tmp_path) == []
    assert main(["verify", str(tmp_path)]) == 0
    assert f"all {len(sums)} files intact" in capsys.readouterr().out
    # nothing but the trace is left: no staging folder, no lock file
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_flipped_byte_in_a_shard_is_named(lm, tmp_path, capsys):
    cw.trace(lm, IDS_A, out=tmp_path, measures="attention,contribution")
    shard = tmp_path / "maps" / "layer-001.safetensors"
    _flip(shard)
    damaged = verify(tmp_path)
    assert [d.file for d in damaged] == ["maps/layer-001.safetensors"]
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "1 of" in out and "maps/layer-001.safetensors" in out
    with pytest.raises(TraceFileError, match=r"layer-001\.safetensors"):
        cw.Trace.load(tmp_path, verify=True)
    # loaded lazily, the intact layer reads; reading the damaged layer whole is refused
    lazy = cw.Trace.load(tmp_path)
    assert lazy["attention"][0].shape[0] == lm.num_heads
    with pytest.raises(TraceFileError, match=r"layer-001\.safetensors is damaged"):
        lazy["attention"][1]
    # a slice of a head is read without the whole-shard check (that is what verify is for)
    lazy["attention"][1, 0, :2]


def test_a_flipped_byte_in_the_vectors_is_named(lm, tmp_path):
    cw.trace(lm, IDS_A, out=tmp_path, maps=False)
    _flip(tmp_path / "vectors.safetensors")
    assert [d.file for d in verify(tmp_path)] == ["vectors.safetensors"]
    (tmp_path / "tokens.json").unlink()
    assert {d.file: d.problem for d in verify(tmp_path)}["tokens.json"] == "missing"


def test_verify_without_checksums_or_without_a_trace_exits_2(lm, tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 2
    assert "holds no trace" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("x")
    assert main(["verify", str(tmp_path / "a-file")]) == 2
    assert "it is a file" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "meta.json").write_text('{"x": 1}')
    assert main(["verify", str(tmp_path / "other")]) == 2
    assert "is not a trace's meta.json" in capsys.readouterr().err
    (tmp_path / "a-file").unlink()
    cw.trace(lm, IDS_A, out=tmp_path, maps=False)
    meta = json.loads((tmp_path / "meta.json").read_text())
    del meta["checksums"]  # as a trace of an earlier version
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert main(["verify", str(tmp_path)]) == 2
    assert "records no checksums" in capsys.readouterr().err
    cw.Trace.load(tmp_path)  # still loads


def test_saving_replaces_the_earlier_trace_and_keeps_other_files(lm, tmp_path):
    cw.trace(lm, IDS_A, out=tmp_path, measures="attention")
    (tmp_path / "heatmaps.png").write_bytes(b"a figure of the earlier trace")
    (tmp_path / "notes.txt").write_text("mine")
    memory = cw.trace(lm, IDS_B, measures="attention")
    memory.save(tmp_path, storage="float16", overwrite=True)
    _same_trace(tmp_path, IDS_B)
    assert not (tmp_path / "heatmaps.png").exists()  # the earlier trace's figure is gone
    assert (tmp_path / "notes.txt").read_text() == "mine"
    # the returned trace of a streamed run reads its maps from the final folder
    streamed = cw.trace(lm, IDS_A, out=tmp_path / "s", measures="attention")
    assert streamed.path == tmp_path / "s"
    assert torch.equal(
        streamed["attention"].tensor(), cw.Trace.load(tmp_path / "s")["attention"].tensor()
    )


_HOLD = """
import sys, time
sys.path.insert(0, {src!r})
from contribution_weights.tracing.folder import writer_lock
with writer_lock({folder!r}):
    print("locked", flush=True)
    sys.stdin.readline()
"""


def test_a_second_writer_is_refused_naming_the_other_process(lm, tmp_path, capsys):
    folder = tmp_path / "busy"
    cw.trace(lm, IDS_A, out=folder, maps=False)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD.format(src=str(SRC), folder=str(folder))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(TraceFolderBusy, match=f"process {holder.pid} "):
            cw.trace(lm, IDS_B, out=folder, maps=False, overwrite=True)
        model = save_tiny("llama", tmp_path / "model")
        argv = ["trace", "--text", "abc", "--model", str(model), "--out", str(folder)]
        argv += ["--overwrite"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert str(folder) in err and f"process {holder.pid}" in err
    finally:
        holder.communicate("\n", timeout=60)
    _same_trace(folder, IDS_A)  # the refused writers changed nothing
    cw.trace(lm, IDS_B, out=folder, maps=False, overwrite=True)  # released: the next goes ahead
    _same_trace(folder, IDS_B)


_KILLED = """
import os, signal, sys
sys.path[:0] = [{src!r}, {tests!r}]
import torch
import contribution_weights as cw
from contribution_weights.tracing import storage
from tiny_models import tiny_model

finish = storage.PackedMaps.finish_layer
def die_at_the_second_layer(self, pos):
    if pos == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup of any kind runs
    finish(self, pos)
storage.PackedMaps.finish_layer = die_at_the_second_layer
cw.trace(tiny_model("llama"), torch.tensor({ids}), out={folder!r}, overwrite=True)
"""


def test_a_killed_writer_leaves_the_earlier_trace(lm, tmp_path):
    cw.trace(lm, IDS_A, out=tmp_path)
    script = _KILLED.format(
        src=str(SRC), tests=str(TESTS), ids=IDS_B.tolist(), folder=str(tmp_path)
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert run.returncode == -9, run.stderr.decode()[-2000:]
    staging = [p.name for p in tmp_path.glob(".partial-*")]
    assert len(staging) == 1  # its unfinished files, apart from the trace
    _same_trace(tmp_path, IDS_A)
    cw.trace(lm, IDS_B, out=tmp_path, overwrite=True)  # the next writer clears them
    assert not list(tmp_path.glob(".partial-*"))
    _same_trace(tmp_path, IDS_B)


@pytest.mark.parametrize("fail_at", range(6))
def test_a_move_interrupted_at_any_step_leaves_the_old_trace_or_none(
    lm, tmp_path, monkeypatch, fail_at
):
    cw.trace(lm, IDS_A, out=tmp_path)
    real = os.replace
    calls = []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) > fail_at:
            raise OSError("the disk went away")
        real(src, dst)

    monkeypatch.setattr(folder_mod.os, "replace", replace)
    with pytest.raises(OSError, match="went away"):
        cw.trace(lm, IDS_B, out=tmp_path, overwrite=True)
    monkeypatch.undo()
    try:
        loaded = cw.Trace.load(tmp_path)
    except TraceFileError as err:
        assert "holds no trace" in str(err)  # none: never a mix of the two
    else:
        assert loaded.input_ids.tolist() == IDS_A.tolist()
        assert verify(tmp_path) == []
    assert not list(tmp_path.glob(".partial-*"))  # an error (not a kill) cleans up


def test_refused_runs_leave_no_folder(tmp_path):
    folder = tmp_path / "new"
    with pytest.raises(RuntimeError), folder_mod.writer_lock(folder):
        raise RuntimeError("the model failed to load")
    assert not folder.exists()


def test_the_lock_is_reentrant_within_a_process(tmp_path):
    with folder_mod.writer_lock(tmp_path), folder_mod.writer_lock(tmp_path):
        assert (tmp_path / folder_mod.LOCK_NAME).exists()
    assert not (tmp_path / folder_mod.LOCK_NAME).exists()


def test_the_lock_module_imports_without_torch():
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(SRC)!r})
        import contribution_weights.tracing.folder
        assert "torch" not in sys.modules, "tracing.folder imported torch"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
