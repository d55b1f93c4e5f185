"""``cw attribute`` and ``cw.attribute``: bad targets fail before the model loads; a run
writes its files; the API's keyword forms."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_models import save_tiny, tiny_model

import contribution_weights as cw
from contribution_weights import loading
from contribution_weights.attribution.result import Attribution
from contribution_weights.attribution.targets import Target, TargetError
from contribution_weights.cli import main


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--position", "99"], "out of range"),
        (["--quantity", "contrast"], "needs a foil"),
        (["--continuation", " "], "continuation is empty"),
        (["--token-id", "5000"], "outside the model's vocabulary"),
        (["--token", "ab", "--foil", "ab", "--quantity", "contrast"], "contrasted with itself"),
        (["--token", "abc"], "not one"),
        (["--methods", "nope"], "unknown attribution method"),
        (["--foil", "a"], "only read by --quantity contrast"),
    ],
)
def test_bad_targets_exit_2_before_the_model_loads(folder, monkeypatch, capsys, args, message):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the target was checked")

    monkeypatch.setattr(loading, "load_model", refuse)
    code = main(["attribute", "--text", "abcdef", "--model", str(folder), *args])
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_run_writes_json_figures_routes_and_html(folder, tmp_path, capsys):
    out = tmp_path / "a"
    code = main(
        ["attribute", "--text", "abcabcab", "--model", str(folder), "--methods",
         "flow,rollout", "--routes", "--threshold", "0.05", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "target 0:" in printed and "flow" in printed and "rollout" in printed
    for name in ("attribution.json", "routes.json", "attribution.png", "routes.png",
                 "attribution.html"):  # fmt: skip
        assert (out / name).is_file(), name
    loaded = Attribution.load(out)
    assert loaded.methods == ["flow", "rollout"]
    assert loaded["flow"].shape == (1, len(loaded.tokens))
    graphs = json.loads((out / "routes.json").read_text())
    networkx = pytest.importorskip("networkx")
    graph = networkx.node_link_graph(graphs[0], edges="edges")
    assert graph.number_of_edges() == len(loaded.routes[0].edges) > 0


def test_api_keywords_and_targets():
    model = tiny_model("qwen3", dtype=torch.float64)
    ids = torch.randint(3, 90, (12,))
    a = cw.attribute(model, ids, method="flow", target=5, quantity="logit")
    assert a.targets[0].position == 5 and a.targets[0].quantity == "logit"
    b = cw.attribute(model, ids, method="flow", target=Target(5, a.targets[0].token, "logit"))
    torch.testing.assert_close(a["flow"], b["flow"])
    # bias-free family: the scores decompose the logit (up to the float32 softmax)
    assert a["flow"].sum().item() == pytest.approx(a.values[0], abs=1e-5)
    assert (a["flow"][0, 6:] == 0).all()  # nothing after the target drives it
    cont = cw.attribute(model, ids[:8], continuation=[9, 10, 11], methods=["flow"])
    assert [t.position for t in cont.targets] == [7, 8, 9]
    with_routes = cw.attribute(model, ids, methods="rollout", routes=True)  # flow added: read
    assert with_routes.methods == ["rollout", "flow"] and with_routes.routes  # from flow
    assert "flow" in a.summary() and a.top(3)[0][0] in range(6)


def test_direct_method_through_the_api():
    """``direct`` (alias ``one_hop``) runs beside flow from the same kind of forward, its
    scores decompose the same logit, and a pure flow target is refused."""
    model = tiny_model("qwen3", dtype=torch.float64)
    ids = torch.randint(3, 90, (12,))
    a = cw.attribute(model, ids, methods="flow,one_hop", target=5, quantity="logit")
    assert a.methods == ["flow", "direct"]
    assert a["direct"].sum().item() == pytest.approx(a.values[0], abs=1e-5)
    assert (a["direct"][0, 6:] == 0).all()
    assert not torch.allclose(a["direct"], a["flow"])
    with pytest.raises(TargetError, match="direct method explains a scalar"):
        cw.attribute(model, ids, methods="direct", quantity="flow")


def test_magnitude_twins_are_their_methods_absolute_values():
    """``NAME_abs`` reports ``|NAME|``: computed on its own (same scores as the signed
    method's, made absolute) or taken from the signed method that ran on the same input,
    with the same seconds; it decomposes nothing, and it is not part of ``all``."""
    from contribution_weights.attribution.methods import METHODS

    model = tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(3, 90, (12,))
    both = cw.attribute(model, ids, methods="direct_abs,direct,input_x_gradient_abs", target=7)
    assert both.methods == ["direct_abs", "direct", "input_x_gradient_abs"]
    assert torch.equal(both["direct_abs"], both["direct"].abs())
    assert both.seconds["direct_abs"] == both.seconds["direct"]
    assert (both["direct"] < 0).any()  # the case that makes the twin differ
    alone = cw.attribute(model, ids, methods="direct_abs,input_x_gradient", target=7)
    assert torch.allclose(alone["direct_abs"], both["direct_abs"])
    assert torch.allclose(both["input_x_gradient_abs"], alone["input_x_gradient"].abs())
    assert math.isnan(alone.explained["direct_abs"][0])
    assert math.isnan(alone.remainder["direct_abs"][0])
    assert "direct_abs" not in METHODS.resolve("all")
    assert {"flow_abs", "integrated_gradients_abs", "feature_ablation_abs"} <= set(METHODS.names())


def test_flow_alone_runs_one_forward():
    """The flow's own forward resolves the targets: no second forward for the logits."""
    model = tiny_model("llama")
    calls = []
    handle = model.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        cw.attribute(model, torch.randint(3, 90, (12,)), methods="flow")
    finally:
        handle.remove()
    assert len(calls) == 1


def test_a_second_run_without_routes_leaves_no_stale_routes(folder, tmp_path, capsys):
    """An earlier run's routes (files and figure) are not left beside another attribution,
    and the "wrote" line lists what this run wrote."""
    out = tmp_path / "a"
    base = ["attribute", "--model", str(folder), "--out", str(out)]
    assert main([*base, "--text", "abcabcab", "--routes"]) == 0
    assert (out / "routes.json").is_file() and (out / "routes.png").is_file()
    capsys.readouterr()
    assert main([*base, "--text", "bcdbcd"]) == 0
    wrote = capsys.readouterr().out.strip().splitlines()[-1]
    assert wrote.startswith("wrote ") and "routes" not in wrote and "attribution.json" in wrote
    assert not (out / "routes.json").exists() and not (out / "routes.png").exists()
    assert Attribution.load(out).routes is None


def test_a_continuation_is_never_truncated(folder, monkeypatch, capsys):
    """--truncate would cut the prompt's end, just before the continuation: refused, and
    --max-tokens counts the prompt and the continuation together, before the model loads."""

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the length was checked")

    monkeypatch.setattr(loading, "load_model", refuse)
    base = ["attribute", "--text", "abcdef", "--model", str(folder), "--continuation", "gh"]
    assert main([*base, "--max-tokens", "40", "--truncate"]) == 2  # refused, even if it fits
    assert "never truncated" in capsys.readouterr().err
    assert main([*base, "--max-tokens", "7"]) == 2
    err = capsys.readouterr().err
    assert "never truncated" in err and "more than 7" in err
    assert (
        main([*base[:-2], "--methods", "flow", "--method", "flow,rollout", "--max-tokens", "0"])
        == 2
    )
    err = capsys.readouterr().err  # --method, the older spelling, is still read (with a warning)
    assert "--method is deprecated; use --methods" in err and "at least 2" in err


def test_api_continuation_length_and_top_tokens():
    model = tiny_model("qwen3", dtype=torch.float64)
    ids = torch.randint(3, 90, (8,))
    with pytest.raises(TargetError, match="make 11 tokens, more than 10"):
        cw.attribute(model, ids, continuation=[9, 10, 11], max_tokens=10)
    with pytest.raises(TargetError, match="never truncated"):
        cw.attribute(model, ids, continuation=[9, 10, 11], max_tokens=10, truncate=True)
    a = cw.attribute(model, ids, target=4, quantity="logit")
    assert a.methods == ["direct"]  # the default
    top = a.top(10)  # token 0 aside (exclude_first=True, as the evaluations)
    row = a["direct"][0]
    order = torch.argsort(row[:5].abs(), descending=True).tolist()
    assert [p for p, _, _ in top] == [p for p in order if p != 0]
    assert all(p <= 4 for p, _, _ in top)  # no token after the target is listed
    assert [s for _, _, s in top] == pytest.approx(row[[p for p, _, _ in top]].tolist())


ATTRIBUTION_PLUGIN = """
import torch
from contribution_weights.attribution.run import MethodOutput


def first_token(model, ids, targets, options):
    scores = torch.zeros(len(targets), ids.numel())
    scores[:, 0] = 1.0
    return MethodOutput(scores)
"""


SIGNED_PLUGIN = """
import torch
from contribution_weights.attribution.run import MethodOutput


def alternating(model, ids, targets, options):
    signs = torch.tensor([(-1.0) ** k for k in range(ids.numel())])
    scores = (torch.arange(ids.numel()) + 1.0) * signs
    return MethodOutput(scores.unsqueeze(0).repeat(len(targets), 1))
"""


def test_a_users_signed_method_brings_its_magnitude_twin(tmp_path, monkeypatch):
    """``signed=True`` registers ``NAME_abs`` with the method (outside ``all``); the twin
    reports |scores|; the same name registered again unsigned takes its twin away; a twin
    cannot itself be signed."""
    import sys

    from contribution_weights.attribution.methods import METHODS

    (tmp_path / "cw_signed_plugin.py").write_text(SIGNED_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        cw.register_attribution_method(
            cw.AttributionMethod("alt", "cw_signed_plugin:alternating", "a test", signed=True)
        )
        assert METHODS.get("alt_abs").absolute_of == "alt"
        assert "alt_abs" not in METHODS.resolve("all") and "alt" in METHODS.resolve("all")
        result = cw.attribute(tiny_model("llama"), "one two three four", methods="alt_abs,alt")
        assert (result["alt"] < 0).any()
        assert torch.equal(result["alt_abs"], result["alt"].abs())
        cw.register_attribution_method(
            cw.AttributionMethod("alt", "cw_signed_plugin:alternating", "a test")
        )
        assert "alt_abs" not in METHODS
        with pytest.raises(ValueError, match="has no sign"):
            cw.AttributionMethod("x_abs", "m:f", "a test", signed=True, absolute_of="x")
    finally:
        for name in ("alt", "alt_abs"):
            METHODS.unregister(name)
        sys.modules.pop("cw_signed_plugin", None)


def test_a_method_from_a_users_module_runs_in_the_api_and_the_cli(
    folder, tmp_path, monkeypatch, capsys
):
    """An entry ``"mymodule:function"`` names a top-level module of the user's (a module
    name without a dot used to be looked for inside the package only)."""
    import sys

    from contribution_weights.attribution.methods import METHODS

    (tmp_path / "cw_attr_plugin.py").write_text(ATTRIBUTION_PLUGIN)
    (tmp_path / "cw_attr_register.py").write_text(
        "import contribution_weights as cw\n"
        "cw.register_attribution_method(cw.AttributionMethod("
        "'first_token', 'cw_attr_plugin:first_token', 'all on token 0 (a test)', scalar=False))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        cw.register_attribution_method(
            cw.AttributionMethod("first_token", "cw_attr_plugin:first_token", "a test")
        )
        result = cw.attribute(tiny_model("llama"), "one two three four", methods="first_token")
        assert result["first_token"][0, 0] == 1 and float(result["first_token"][0, 1:].sum()) == 0
        METHODS.unregister("first_token")
        # from the shell: CW_PLUGINS imports the module that registers it
        monkeypatch.setenv("CW_PLUGINS", "cw_attr_register")
        out = tmp_path / "run"
        args = ["attribute", "--model", str(folder), "--text", "one two three four",
                "--methods", "first_token", "--out", str(out)]  # fmt: skip
        assert main(args) == 0, capsys.readouterr().err
        saved = json.loads((out / "attribution.json").read_text())
        assert saved["scores"]["first_token"][0][0] == 1.0
    finally:
        if "first_token" in METHODS.names():
            METHODS.unregister("first_token")
        for name in ("cw_attr_plugin", "cw_attr_register"):
            sys.modules.pop(name, None)


def test_an_entry_without_a_function_is_a_clear_error():
    from contribution_weights.attribution.methods import METHODS
    from contribution_weights.attribution.run import method_function

    entries = {
        "json:": "names no function",
        "loads": "names no module",
        "json:nope": "has no function 'nope'",
        "json:decoder": "has no function 'decoder'",  # a submodule, not a function
        "no_such_module_xyz:f": "cannot import module 'no_such_module_xyz'",
        # a user module named like one of the package's: the user's, not the package's
        "methods:register_attribution_method": "cannot import module 'methods'",
    }
    try:
        for k, (entry, message) in enumerate(entries.items()):
            cw.register_attribution_method(cw.AttributionMethod(f"bad{k}", entry, "a test"))
            with pytest.raises(ValueError, match=message):
                method_function(f"bad{k}")
    finally:
        for k in range(len(entries)):
            METHODS.unregister(f"bad{k}")


def test_top_zero_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["attribute", "--text", "abcdef", "--top", "0"])
    assert stop.value.code == 2 and "--top: must be at least 1" in capsys.readouterr().err


def test_resumed_options_keep_the_runs_own_and_say_only_what_differs():
    """What ``--resume`` keeps from a folder and says: nothing said for a run made with the
    defaults (``all`` is stored as its names); a boolean flag and an empty list that differ
    are said as given; a folder of another experiment, or of other inputs, lends nothing."""
    import argparse

    from contribution_weights.cli.options import held_options, said_held
    from contribution_weights.experiments.attribution_eval import AttributionEvalOptions
    from contribution_weights.experiments.options import KVEvalOptions

    args = argparse.Namespace(out="run", resume=True, n=8)
    held = {"experiment": "kv-eval", **KVEvalOptions(task="ruler").to_dict()}
    kept = held_options(KVEvalOptions, args, held, {"task": "ruler"}, "kv-eval")
    assert "methods" in kept and "n" not in kept and "task" not in kept  # given, fixed
    assert said_held(KVEvalOptions, kept, {"task": "ruler"}) == ""
    options = AttributionEvalOptions(protect_first=False, baselines="none", n=8)
    held = {"experiment": "attribution-eval", **options.to_dict()}
    kept = held_options(AttributionEvalOptions, args, held, {}, "attribution-eval")
    assert said_held(AttributionEvalOptions, kept) == "--baselines none --no-sink-protection"
    assert held_options(AttributionEvalOptions, args, held, {}, "kv-eval") == {}
    assert held_options(AttributionEvalOptions, args, held, {"task": "lookup"}, "") == {}


def test_attribution_eval_adds_a_method_to_a_finished_run(folder, tmp_path, monkeypatch, capsys):
    """``cw attribution-eval --resume --add-methods direct`` on a finished run: the new
    method's rows in their own file and in the printed summary; a method the run has is
    refused (exit 2) before the model loads."""
    out, texts = tmp_path / "run", tmp_path / "texts.jsonl"
    lines = ["abcdefghijklmnopqrstuvwxyz" * 2, "the quick brown fox jumps over the lazy dog"]
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    base = ["attribution-eval", "--texts", str(texts), "--n", "2", "--tokens", "20",
            "--methods", "flow", "--rates", "0.5", "--interventions", "key_mask",
            "--model", str(folder), "--out", str(out)]  # fmt: skip
    assert main(base) == 0
    rows = (out / "rows.csv").read_text()
    capsys.readouterr()
    assert main([*base, "--resume", "--add-methods", "direct"]) == 0
    printed = capsys.readouterr().out
    assert "direct" in printed and "added-direct.csv" in printed
    assert (out / "rows.csv").read_text() == rows
    assert json.loads((out / "config.json").read_text())["added_methods"] == ["direct"]
    # resuming with no options: the run's own, said on stderr (not today's defaults)
    bare = ["attribution-eval", "--texts", str(texts), "--model", str(folder), "--out", str(out)]
    assert main([*bare, "--resume"]) == 0
    said = capsys.readouterr().err
    assert "with its options: --n 2 --tokens 20 --methods flow --add-methods direct" in said
    assert "--rates 0.5 --interventions key_mask" in said
    assert (out / "rows.csv").read_text() == rows
    assert main([*bare, "--resume", "--tokens", "24"]) == 2  # a flag given still counts
    assert "tokens: 20 in the folder, 24 now" in capsys.readouterr().err

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(loading, "load_model", refuse)
    assert main([*base, "--resume", "--add-methods", "flow"]) == 2
    assert "already among --methods" in capsys.readouterr().err


def test_resume_alone_keeps_the_runs_task_and_model(tmp_path, capsys):
    """``--resume --out DIR`` needs neither --task nor --model for a known-answer run: the
    run's own are kept; a deletion run names the texts it needs again (exit 2), and a new
    run without inputs is refused as argparse would."""
    import argparse

    from contribution_weights.cli.experiment_cmd import INPUTS, keep_held_model
    from contribution_weights.runs import RunFolder

    inputs = INPUTS["attribution"]
    out = tmp_path / "run"
    out.mkdir()
    held = {"experiment": "attribution-eval", "model": "gemma3-270m", "task": "passkey"}
    (out / "config.json").write_text(json.dumps(held))

    def args(**given):
        blank = dict(dataset=None, texts=None, task=None, model=None, resume=True, out=out)
        return argparse.Namespace(**{**blank, **given})

    config = RunFolder.held_config(out)
    resumed = args()
    keep_held_model(resumed, config)
    assert inputs.resolve(resumed, config) is None
    assert (resumed.task, resumed.model) == ("passkey", "gemma3-270m")
    given = args(task="lookup", model="smollm2")
    keep_held_model(given, config)
    assert inputs.resolve(given, config) is None
    assert (given.task, given.model) == ("lookup", "smollm2")
    deletion = {**held, "task": "deletion"}
    (out / "config.json").write_text(json.dumps(deletion))
    assert "give its --dataset NAME or --texts FILE.jsonl again" in inputs.resolve(args(), deletion)
    assert main(["attribution-eval", "--resume", "--out", str(out)]) == 2
    assert "give its --dataset NAME" in capsys.readouterr().err
    assert main(["attribution-eval", "--out", str(tmp_path / "new")]) == 2
    assert "one of the arguments --dataset --texts --task is required" in capsys.readouterr().err
