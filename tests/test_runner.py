"""The experiment runner: save/load symmetry, run_info, resume by content, file modes."""

from __future__ import annotations

import json
import os
import stat

import pandas as pd
import pytest
from tiny_models import tiny_model

from contribution_weights.cli import main
from contribution_weights.data import ChoiceItem
from contribution_weights.experiments.downstream import DownstreamResult, downstream
from contribution_weights.experiments.faithfulness import FaithfulnessResult, faithfulness
from contribution_weights.experiments.runner import resume_hint

TEXTS = ["the cat sat on the mat", "  ", "water boils at one hundred degrees"]
ITEMS = [
    ChoiceItem("the sky is", ["blue", "green"], 0),
    ChoiceItem("two and two make", ["four", "five"], 0),
]


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama")


def test_faithfulness_result_saves_and_loads_back_into_a_new_folder(lm, tmp_path):
    res = faithfulness(lm, TEXTS, measures=["vw"], rates=[0.5], progress=False)
    folder = res.save(tmp_path / "saved")
    assert json.loads((folder / "config.json").read_text())["experiment"] == "faithfulness"
    back = FaithfulnessResult.load(folder)
    pd.testing.assert_frame_equal(back.per_sequence, res.per_sequence)
    pd.testing.assert_frame_equal(back.summary, res.summary)
    assert back.config == res.config and back.run_info == res.run_info
    assert [s["unit"] for s in back.skipped] == [1]


def test_downstream_result_saves_and_loads_back(lm, tmp_path):
    res = downstream(lm, ITEMS, task="t", measures=["vw"], rates=[0.5], progress=False)
    back = DownstreamResult.load(res.save(tmp_path / "d"))
    pd.testing.assert_frame_equal(back.per_item, res.per_item)
    pd.testing.assert_frame_equal(back.summary, res.summary)
    assert back.config == res.config and back.seconds == res.seconds


def test_a_run_folder_loads_as_its_result(lm, tmp_path):
    res = faithfulness(lm, TEXTS, measures=["vw"], rates=[0.5], out=tmp_path / "r",
                       progress=False)  # fmt: skip
    info = json.loads((tmp_path / "r" / "run_info.json").read_text())
    assert info["skipped"] == [{"phase": "faithfulness", "unit": 1, "reason": "blank text"}]
    assert info["processes"] == 1 and "seconds" in info and "transformers" in info["versions"]
    back = FaithfulnessResult.load(tmp_path / "r")
    pd.testing.assert_frame_equal(back.per_sequence, res.per_sequence)


def test_load_without_config_says_what_folder_it_needs(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"result\.save"):
        FaithfulnessResult.load(tmp_path)


def test_run_files_are_written_0644(lm, tmp_path):
    old = os.umask(0o022)
    try:
        faithfulness(lm, TEXTS[:1], measures=["vw"], rates=[0.5], out=tmp_path / "r",
                     progress=False)  # fmt: skip
    finally:
        os.umask(old)
    for f in (tmp_path / "r").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f.name


def test_resume_accepts_the_same_file_under_another_path_spelling(lm, tmp_path, monkeypatch):
    monkeypatch.setattr("contribution_weights.loading.load_model", lambda *a, **k: lm)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text("the cat sat on the mat\n\nwater boils")
    args = ["faithfulness", "--measures", "vw", "--rates", "0.5", "--out", "o"]
    assert main([*args, "--file", "t.txt"]) == 0
    assert main([*args, "--file", str(tmp_path / "." / "t.txt"), "--resume"]) == 0
    (tmp_path / "t.txt").write_text("other text entirely")
    assert main([*args, "--file", "t.txt", "--resume"]) == 2  # other content: refused


def test_a_run_folder_is_checked_before_the_model_loads_and_a_refusal_shows_values(
    lm, tmp_path, monkeypatch, capsys
):
    (tmp_path / "t.txt").write_text("the cat sat on the mat\n\nwater boils")
    args = ["faithfulness", "--file", str(tmp_path / "t.txt"), "--measures", "vw",
            "--out", str(tmp_path / "o")]  # fmt: skip
    monkeypatch.setattr("contribution_weights.loading.load_model", lambda *a, **k: lm)
    assert main([*args, "--rates", "0.5", "--resume"]) == 0  # no run yet: one starts, said so
    assert "--resume starts a new one" in capsys.readouterr().err

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the run folder was checked")

    monkeypatch.setattr("contribution_weights.loading.load_model", refuse)
    assert main([*args, "--rates", "0.5"]) == 2
    assert "already holds a run; pass --resume" in capsys.readouterr().err
    monkeypatch.setattr("contribution_weights.loading.load_model", lambda *a, **k: lm)
    assert main([*args, "--rates", "0.3", "--resume"]) == 2
    assert "rates: [0.5] in the folder, [0.3] now" in capsys.readouterr().err


def test_a_folder_with_other_files_but_no_run_is_refused_before_the_model_loads(
    tmp_path, monkeypatch, capsys
):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the run folder was checked")

    monkeypatch.setattr("contribution_weights.loading.load_model", refuse)
    (tmp_path / "t.txt").write_text("the cat sat on the mat")
    out = tmp_path / "notes"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for extra in ([], ["--resume"]):
        args = ["faithfulness", "--file", str(tmp_path / "t.txt"), "--out", str(out), *extra]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "holds other files (notes.txt) but no run" in err and "new or empty" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # nothing written there


def test_interrupted_run_says_how_to_resume(lm, tmp_path, monkeypatch, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("contribution_weights.loading.load_model", lambda *a, **k: lm)
    monkeypatch.setattr("contribution_weights.experiments.faithfulness.faithfulness", interrupted)
    (tmp_path / "t.txt").write_text("the cat")
    argv = ["faithfulness", "--file", str(tmp_path / "t.txt"), "--out", str(tmp_path / "o")]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and resume_hint(argv) in err
    assert resume_hint(argv).endswith("--resume") and resume_hint(argv).startswith("cw faith")


def test_sigterm_ends_a_run_like_ctrl_c_keeping_its_run_info(lm, tmp_path, monkeypatch, capsys):
    import signal

    from contribution_weights.experiments import faithfulness as faith_module

    real = faith_module.sequence_rows
    calls = []

    def second_is_terminated(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr("contribution_weights.loading.load_model", lambda *a, **k: lm)
    monkeypatch.setattr(faith_module, "sequence_rows", second_is_terminated)
    (tmp_path / "t.txt").write_text("the cat sat on the mat\n\nwater boils at one hundred")
    argv = ["faithfulness", "--file", str(tmp_path / "t.txt"), "--measures", "vw",
            "--rates", "0.5", "--out", str(tmp_path / "o")]  # fmt: skip

    def ignore(signum, frame):  # without cw's handler the signal lands here, not in pytest
        pass

    before = signal.signal(signal.SIGTERM, ignore)
    try:
        assert main(argv) == 143  # 128 + SIGTERM, as a shell reports it
        assert "terminated" in capsys.readouterr().err
        assert signal.getsignal(signal.SIGTERM) is ignore  # the caller's handler is put back
    finally:
        signal.signal(signal.SIGTERM, before)
    info = json.loads((tmp_path / "o" / "run_info.json").read_text())
    assert info["finished"] is False
    assert len(pd.read_csv(tmp_path / "o" / "per_sequence.csv").seq.unique()) == 1


def test_seconds_add_up_over_an_interrupted_session_and_its_resume(lm, tmp_path, monkeypatch):
    from contribution_weights.experiments import faithfulness as faith_module

    texts = ["the cat sat on the mat", "water boils at one hundred degrees"]
    real = faith_module.sequence_rows
    calls = []

    def second_interrupts(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(faith_module, "sequence_rows", second_interrupts)
    kw = dict(measures=["vw"], rates=[0.5], out=tmp_path / "r", progress=False)
    with pytest.raises(KeyboardInterrupt):
        faithfulness(lm, texts, **kw)
    info = json.loads((tmp_path / "r" / "run_info.json").read_text())
    assert info["finished"] is False and info["seconds"] >= 0
    info["seconds"] = 1000.0  # as if the first session had run that long
    (tmp_path / "r" / "run_info.json").write_text(json.dumps(info))
    res = faithfulness(lm, texts, resume=True, **kw)
    assert res.run_info["finished"] is True and 1000.0 <= res.run_info["seconds"] < 1100
    assert res.per_sequence.seq.nunique() == 2


@pytest.mark.parametrize("every, on_disk", [(0.0, True), (3600.0, False)])
def test_a_running_session_keeps_its_seconds_on_disk_for_a_kill_it_cannot_catch(
    lm, tmp_path, monkeypatch, every, on_disk
):
    from contribution_weights.experiments import faithfulness as faith_module
    from contribution_weights.experiments import runner

    monkeypatch.setattr(runner, "INFO_EVERY", every)
    info_file = tmp_path / "r" / "run_info.json"
    real = faith_module.sequence_rows
    seen = []  # run_info.json as the second unit starts: what a SIGKILL there would leave

    def second_looks(*a, **k):
        seen.append(json.loads(info_file.read_text()) if info_file.exists() else None)
        return real(*a, **k)

    monkeypatch.setattr(faith_module, "sequence_rows", second_looks)
    texts = ["the cat sat on the mat", "water boils at one hundred degrees"]
    res = faithfulness(lm, texts, measures=["vw"], rates=[0.5], out=tmp_path / "r", progress=False)
    assert seen[0] is None  # nothing before the first unit has finished
    if on_disk:
        assert seen[1]["finished"] is False and 0 <= seen[1]["seconds"] <= res.seconds
    else:  # not rewritten more often than every INFO_EVERY seconds
        assert seen[1] is None
    assert json.loads(info_file.read_text())["finished"] is True


def test_an_error_while_rendering_keeps_the_finished_run_info(lm, tmp_path, monkeypatch):
    from contribution_weights.experiments.faithfulness import FaithfulnessResult

    def broken(self, folder):
        raise KeyboardInterrupt

    monkeypatch.setattr(FaithfulnessResult, "write_summary", broken)
    with pytest.raises(KeyboardInterrupt):
        faithfulness(lm, TEXTS, measures=["vw"], rates=[0.5], out=tmp_path / "r", progress=False)
    info = json.loads((tmp_path / "r" / "run_info.json").read_text())
    assert info["finished"] is True and info["units"] == {"faithfulness": len(TEXTS)}


def test_a_run_where_every_unit_was_skipped_exits_1_without_a_table(
    lm, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr("contribution_weights.loading.load_model", lambda *a, **k: lm)
    (tmp_path / "t.txt").write_text("a")  # one token: nothing to remove, skipped
    args = ["faithfulness", "--file", str(tmp_path / "t.txt"), "--measures", "vw",
            "--rates", "0.5", "--out", str(tmp_path / "o")]  # fmt: skip
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "Empty DataFrame" not in captured.out and "skipped 1 units" in captured.out
    assert "no result: no unit could run" in captured.err


def test_an_extendable_key_may_grow_on_resume_and_nothing_else(tmp_path):
    """A list named extendable may gain entries at its end (the folder's config is
    rewritten with them); another order, a removed entry or another key is refused."""
    from contribution_weights.runs import RunFolder, RunFolderError

    config = {"experiment": "x", "n": 2, "added": ["a"]}
    RunFolder(tmp_path, config)
    grown = {**config, "added": ["a", "b"]}
    RunFolder.check(tmp_path, grown, resume=True, extendable=("added",))
    with pytest.raises(RunFolderError, match="added"):
        RunFolder.check(tmp_path, grown, resume=True)  # not extendable
    for bad in (["b", "a"], [], ["b"]):
        with pytest.raises(RunFolderError, match="added"):
            RunFolder.check(tmp_path, {**config, "added": bad}, resume=True, extendable=("added",))
    with pytest.raises(RunFolderError, match="n"):
        RunFolder.check(tmp_path, {**grown, "n": 3}, resume=True, extendable=("added",))
    RunFolder(tmp_path, grown, resume=True, extendable=("added",))
    assert json.loads((tmp_path / "config.json").read_text())["added"] == ["a", "b"]
