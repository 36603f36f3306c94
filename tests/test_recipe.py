"""`llmq run`: whole-recipe validation before anything runs, stage reuse, and re-running exactly what changed."""

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from llmq.cli.main import cli
from llmq.errors import LlmqError
from llmq.pipeline.recipe import load_recipe
from llmq.pipeline.runner import run_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def _write(tmp_path: Path, data: dict, name: str = "r.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_validate(recipe):
    r = load_recipe(recipe)
    assert r.name == recipe.stem
    assert r.stages.quantize is not None
    assert r.stages.eval is not None


@pytest.mark.parametrize("stages,message", [
    ({"quantize": {"bits": 4, "metod": "gptq"}}, "stages.quantize.metod: Extra inputs are not permitted"),
    ({"quantize": {"bits": 3}}, "stages.quantize.bits: Input should be 4, 5 or 8"),
    ({"quantize": {"bits": 4, "method": "fp8"}}, "method fp8 quantizes to 8 bits"),
    ({"quantize": {"bits": 4, "alpha": 0.5}}, "alpha is SmoothQuant's migration strength"),
    ({"build": {"tp": 3}}, "stages.build.tp: Input should be 1, 2, 4 or 8"),
    ({"build": {"tp": True}}, "stages.build.tp: Value error, true is a yes/no, this option takes a value"),
    ({"eval": {"limit": False}}, "stages.eval.limit: Value error, false is a yes/no"),
    ({"eval": {"tasks": ["math"], "gate": "nosuchtask>=1"}},
     "stages.eval: Value error, gate nosuchtask>=1: nosuchtask is not a score of --tasks math"),
    ({"eval": {"tasks": ["math"], "gate": "code>=-2"}}, "gate code>=-2: code is not a score of --tasks math"),
    ({"build": {"tp": 2, "kv": "int8"}}, "int8 needs calibrated KV scales; add a quantize-kv stage"),
    ({"quantize-kv": {"kv": "fp8"}, "build": {"kv": "int8"}}, "build.kv: int8 contradicts stages.quantize-kv.kv: fp8"),
    ({"eval": {"tasks": []}}, "stages.eval.tasks: List should have at least 1 item"),
    ({}, "name at least one of"),
    ({"build": {"tp": 1}, "serve": {"port": 8000}}, "stages: Value error, serve is not a recipe stage"),
])
def test_bad_recipes_are_refused_naming_the_key(tmp_path, stages, message):
    p = _write(tmp_path, {"name": "x", "stages": stages})
    with pytest.raises(LlmqError, match="r.yaml: ") as e:
        load_recipe(p)
    assert message in str(e.value)


@pytest.mark.parametrize("eval_stage", [
    {"tasks": ["math", "ppl", "kld"], "gate": "math>=-2,llmq_arith_mc>=-5,ppl<=0.5,kld<=0.1,top1>=50"},
    {"tasks": ["code"], "gate": "code_bpb<=0.1,code>=-3"},
    {"tasks": ["llmq_arith_mc"], "gate": "llmq_arith_mc>=-1"},
])
def test_gates_on_scores_the_tasks_produce_are_accepted(tmp_path, eval_stage):
    assert load_recipe(_write(tmp_path, {"name": "x", "stages": {"eval": eval_stage}})).stages.eval.gate


def test_switches_still_take_yes_no(tmp_path):
    r = load_recipe(_write(tmp_path, {"name": "x", "stages": {"build": {"tp": 2, "pad_heads": False}}}))
    assert r.stages.build.pad_heads is False
    assert r.stages.build.tp == 2


def test_on_off_options_take_yaml_s_bare_on_and_off(tmp_path):
    p = tmp_path / "r.yaml"
    for word in ("on", "off"):   # YAML 1.1 reads both as booleans
        p.write_text(f"name: x\nstages:\n  quantize: {{bits: 4, method: gptq, thinking: {word}}}\n")
        assert load_recipe(p).stages.quantize.to_options().thinking == word


def test_unreadable_recipes(tmp_path):
    with pytest.raises(LlmqError, match="recipe not found"):
        load_recipe(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("name: [unclosed")
    with pytest.raises(LlmqError, match="not valid YAML"):
        load_recipe(tmp_path / "bad.yaml")


def test_build_stages_are_reused_and_rerun_exactly_when_their_inputs_change(tmp_path, store, make_tiny_model):
    model = make_tiny_model(tmp_path / "tiny")
    recipe = {"name": "t", "model": str(model), "stages": {"build": {"tp": 2, "verify": True}}}
    first = run_recipe(load_recipe(_write(tmp_path, recipe)), store)
    assert [r.status for r in first.stages] == ["ran"]
    again = run_recipe(load_recipe(_write(tmp_path, recipe)), store)
    assert [r.status for r in again.stages] == ["reused"]
    assert again.stages[0].artifact.id == first.stages[0].artifact.id
    planned = run_recipe(load_recipe(_write(tmp_path, recipe)), store, dry_run=True)
    assert [r.status for r in planned.stages] == ["would reuse"]

    recipe["stages"]["build"]["tp"] = 4
    changed = run_recipe(load_recipe(_write(tmp_path, recipe)), store)
    assert [r.status for r in changed.stages] == ["ran"]
    assert changed.stages[0].artifact.id != first.stages[0].artifact.id
    forced = run_recipe(load_recipe(_write(tmp_path, recipe)), store, from_stage="build")
    assert [r.status for r in forced.stages] == ["ran"]
    # deterministic: the forced re-run wrote identical bytes, so the same content id
    assert forced.stages[0].artifact.id == changed.stages[0].artifact.id


def test_cli_run_prints_the_table_and_refuses_unknown_from(tmp_path, make_tiny_model):
    model = make_tiny_model(tmp_path / "tiny")
    p = _write(tmp_path, {"name": "t", "model": str(model), "stages": {"build": {"tp": 1}}})
    store = ["--store", str(tmp_path / "store")]
    r = CliRunner().invoke(cli, [*store, "run", str(p)])
    assert r.exit_code == 0, r.output
    assert "recipe t" in r.output
    assert "t-tp1" in r.output
    assert "ran" in r.output
    r = CliRunner().invoke(cli, [*store, "run", str(p), "--from", "quantize"])
    assert r.exit_code == 2
    assert "--from quantize: this recipe's stages are build" in r.output
    r = CliRunner().invoke(cli, [*store, "run", str(tmp_path / "nope.yaml")])
    assert r.exit_code == 2
    assert "recipe not found" in r.output


def test_whole_pipeline_reruns_exactly_what_changed_and_stops_at_a_failing_gate(tmp_path, store, make_tiny_model,
                                                                                 monkeypatch):
    """Every real stage on a tiny model: quantize -> quantize-kv -> build tp 2 (verified) -> eval with gates."""
    monkeypatch.setenv("LLMQ_CACHE", str(tmp_path / "cache"))
    model = make_tiny_model(tmp_path / "tiny")
    recipe = {"name": "t", "model": str(model), "seed": 3, "stages": {
        "quantize": {"bits": 4, "group_size": 32},
        "quantize-kv": {"kv": "int8"},
        "build": {"tp": 2, "kv": "int8", "verify": True},
        "eval": {"tasks": ["math", "kld"], "limit": 3, "gate": "math>=-1000,kld<=1000"}}}
    order = ["quantize", "quantize_kv", "build", "eval"]
    first = run_recipe(load_recipe(_write(tmp_path, recipe)), store)
    assert [r.stage for r in first.stages] == order
    assert {r.status for r in first.stages} == {"ran"}
    assert not first.failed_gates
    q, kv, engine, report = (r.artifact for r in first.stages)
    assert q.parents == [first.model.id]
    assert kv.parents == [q.id]
    assert engine.parents == [kv.id]
    assert report.parents == [engine.id, first.model.id]  # evaluated against the root model
    assert q.config["group_size"] == 32
    assert engine.metrics["verify"]["passed"]

    again = run_recipe(load_recipe(_write(tmp_path, recipe)), store)
    assert [r.status for r in again.stages] == ["reused"] * 4
    forced = run_recipe(load_recipe(_write(tmp_path, recipe)), store, from_stage="quantize")
    assert [r.status for r in forced.stages] == ["ran"] * 4
    # reproducible: re-running every stage from scratch wrote the same bytes
    assert [r.artifact.id for r in forced.stages] == [r.artifact.id for r in first.stages]

    recipe["stages"]["quantize-kv"]["kv"] = "fp8"
    recipe["stages"]["build"]["kv"] = "fp8"
    changed = run_recipe(load_recipe(_write(tmp_path, recipe)), store)
    assert [r.status for r in changed.stages] == ["reused", "ran", "ran", "ran"]
    assert changed.stages[0].artifact.id == q.id
    assert changed.stages[1].artifact.id != kv.id

    recipe["stages"]["eval"]["gate"] = "kld<=0"  # a gate only re-judges the cached report
    gated = run_recipe(load_recipe(_write(tmp_path, recipe)), store)
    assert [r.status for r in gated.stages] == ["reused"] * 4
    assert len(gated.failed_gates) == 1
    assert gated.failed_gates[0].startswith("kld<=0 (kld = ")
    monkeypatch.setattr("llmq.evals.tasks.TASKS_VERSION", 99)  # new task data: eval re-runs, nothing else
    redone = run_recipe(load_recipe(_write(tmp_path, recipe)), store)
    assert [r.status for r in redone.stages] == ["reused"] * 3 + ["ran"]
    r = CliRunner().invoke(cli, ["--store", str(store.root), "run", str(_write(tmp_path, recipe))])
    assert r.exit_code == 1
    assert "quality gate failed: kld<=0" in r.output
    assert "math" in r.output
    assert "KLD" in r.output  # the final table shows the eval's numbers


@pytest.mark.integration
def test_quickstart_runs_end_to_end_on_the_default_model(default_store, tmp_path):
    """The README's main job, every stage on the default model with its gates, then a second run reusing all. Only
    the sizes shrink (8 calibration windows of 128 tokens a quantize stage, 512 probe tokens, 10 items a task);
    every other setting is the shipped recipe's, and its full-size figures are benchmarks/quickstart_results.py's
    (docs/results.json)."""
    data = yaml.safe_load((RECIPES / "quickstart.yaml").read_text())
    for stage in ("quantize", "quantize-kv"):
        data["stages"][stage].update(num_samples=8, seq_len=128, probe_tokens=512)
    data["stages"]["eval"]["limit"] = 10
    recipe, store = _write(tmp_path, data, "quickstart.yaml"), ["--store", str(default_store.root)]
    first = CliRunner().invoke(cli, [*store, "run", str(recipe), "--json"])
    assert first.exit_code == 0, first.output
    out = yaml.safe_load(first.output[first.output.index("{"):])
    assert [s["status"] for s in out["stages"]] == ["ran"] * 4
    assert not out["failed_gates"]
    assert {g["gate"].split(" ")[0] for g in out["gates"]} == {"math>=-20", "code>=-10", "kld<=0.5"}
    engine = default_store.resolve(out["stages"][2]["id"])
    assert engine.metrics["verify"]["passed"]
    assert engine.config["options"]["tp"] == 2
    again = CliRunner().invoke(cli, [*store, "run", str(recipe)])
    assert again.exit_code == 0, again.output
    assert again.output.count("reused") == 4, again.output


def test_duplicate_keys_and_deep_nesting_are_one_line_errors(tmp_path):
    """A second `quantize:` silently replaced the first; a flow list nested 5,000 deep was a RecursionError
    traceback (issue 36, item 9). Both are one-line errors naming the line."""
    p = tmp_path / "dup.yaml"
    p.write_text("name: x\nstages:\n  quantize: {method: rtn, bits: 8}\n  quantize: {method: rtn, bits: 4}\n")
    with pytest.raises(LlmqError, match=r"key 'quantize' given twice \(line 4\)") as e:
        load_recipe(p)
    assert "\n" not in str(e.value)
    p.write_text("name: x\nstages: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(LlmqError, match="nested deeper than 64 levels at line 2") as e:
        load_recipe(p)
    assert "\n" not in str(e.value)
    p.write_text("name: x\nbase: &b {method: rtn, bits: 8}\nstages:\n  quantize: {<<: *b, bits: 4}\n")
    with pytest.raises(LlmqError) as e:  # a merge key overriding a merged one is no duplicate (base is unknown)
        load_recipe(p)
    assert "given twice" not in str(e.value)
