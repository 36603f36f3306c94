"""`llmq report`: the HTML page over recorded artifacts (tests/report_store.py), its sections, what it says where data
is missing or the models differ, and that no artifact-provided string reaches the page unescaped. The page in a real
browser: tests/test_browser.py."""

import base64
import html
import json
import re

import pytest
from click.testing import CliRunner
from report_store import HOSTILE, hostile, replay

from llmq.artifacts import Store
from llmq.artifacts.card import Family, card
from llmq.cli.main import cli
from llmq.report import ReportOptions, write_report

SECTIONS = ("artifacts", "lineage", "size", "kld", "experts", "eval", "bench")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(store, [model, mixed, moe model, moe gptq, eval of mixed, offline bench of gptq, online bench of mixed])."""
    store = Store(tmp_path_factory.mktemp("report") / "store")
    return store, replay(store)


def _page(store, arts, tmp_path, **kw) -> str:
    return write_report(store, arts, ReportOptions(output=str(tmp_path / "r.html")), **kw).read_text()


def _section(page: str, sid: str) -> str:
    return re.search(rf'<section id="{sid}">(.*?)</section>', page, re.S).group(1)


def _svgs(text: str) -> list[str]:
    return [base64.b64decode(b).decode() for b in re.findall(r'src="data:image/svg\+xml;base64,([^"]+)"', text)]


def test_family_and_card_gather_the_lineage_and_its_reports(recorded):
    store, (model, mixed, _, gptq, ev, offline, online) = recorded
    fam = Family.of(store, mixed)
    assert [a.id for a in fam.chain] == [mixed.id, model.id]
    assert [a.id for a in fam.evals] == [ev.id]
    assert [a.id for a in fam.benches] == [online.id]
    c = card(store, mixed)
    assert c["quantization"]["method"] == "rtn"
    assert c["quantization"]["bpw"] == mixed.config["mixed_precision"]["bpw"]
    assert c["kld"]["mean"] == ev.metrics["kld"]
    assert c["kld"]["from"] == f"eval {ev.ref}"
    assert [g["gate"] for g in c["gates"]["gates"]] == ["math>=-20", "code>=-10", "kld<=0.5"]
    # the MoE's card: no eval, so its KLD is its probe's; its bench report is found through the gptq artifact
    g = card(store, gptq)
    assert g["kld"]["mean"] == gptq.metrics["probe"]["kld_mean"]
    assert g["gates"] is None
    assert [a.id for a in Family.of(store, offline).benches] == [offline.id]


def test_every_section_is_drawn_from_the_artifacts(recorded, tmp_path):
    store, (model, mixed, _, gptq, ev, offline, online) = recorded
    page = _page(store, [mixed, gptq], tmp_path)
    assert "<script" not in page
    assert "http://" not in page
    assert "https://" not in page   # nothing to fetch or run
    for sid in SECTIONS:
        assert f'<section id="{sid}">' in page
    assert "different models" in page   # a Llama and a Qwen3-MoE
    lineage = _section(page, "lineage")
    assert lineage.index(model.ref) < lineage.index(mixed.ref)   # source first
    # mixed precision: one heat map of every unit's bits (the schemes written in its cells)
    size = _section(page, "size")
    (heat,) = _svgs(size)[1:]   # after the size bars
    units = mixed.config["mixed_precision"]["units"]
    assert {u["scheme"] for u in units} <= {"int4", "int8", "16bit"}
    assert all(f"<!-- {u['scheme']} -->" in heat for u in units)
    assert f"{mixed.config['mixed_precision']['bpw']:.3f}" in size
    assert "one scheme for every unit: W4A16-group32-sym" in size   # the GPTQ artifact
    kld = _section(page, "kld")
    assert f"{ev.metrics['kld']:.4g}" in kld
    assert f"{gptq.metrics['probe']['kld_mean']:.4g}" in kld
    assert len(_svgs(kld)) == 2   # per layer (mixed precision's sensitivities) and the per-position histograms
    assert "B</span>not measured: measured only by mixed precision" in kld
    experts = _section(page, "experts")
    never = gptq.config["expert_coverage"]["never_routed"]
    assert f"{len(never)} (layer, expert) pairs never routed" in experts
    assert "not a mixture-of-experts model" in experts
    evaluation = _section(page, "eval")
    assert evaluation.count('class="pass"') == 3
    assert "math&gt;=-20" in evaluation
    assert len(_svgs(evaluation)) == 1
    assert "no eval-report" in evaluation   # the forest plot; none for the MoE
    bench = _section(page, "bench")
    assert online.ref in bench
    assert offline.ref in bench
    assert len(_svgs(bench)) == 2   # online curves, offline sweep


def test_the_forest_plot_draws_every_delta_and_gate(recorded, tmp_path):
    """The forest plot's rows are the eval's deltas, each gate at its threshold; a recipe's gate expression is
    judged on the same report instead of the stored gates."""
    store, (_, mixed, *_rest) = recorded
    rep = json.loads(Family.of(store, mixed).evals[0].file("report.json").read_text())
    (svg,) = _svgs(_section(_page(store, [mixed], tmp_path), "eval"))
    for name in rep["deltas"]:
        assert f"<!-- {name} (A) -->" in svg
    assert "<!-- ✓ &gt;=-20 -->" in svg
    assert "<!-- ✓ &gt;=-10 -->" in svg
    judged = _section(_page(store, [mixed], tmp_path, gate="math>=50"), "eval")
    assert 'class="fail">FAIL' in judged
    assert "math&gt;=50" in judged
    assert "code&gt;=-10" not in judged


def test_missing_data_is_not_measured(recorded, tmp_path):
    """A bare model: every section still renders, saying what was not measured and why; nothing raises."""
    store, (model, *_rest) = recorded
    page = _page(store, [model], tmp_path)
    for sid in SECTIONS:
        assert f'<section id="{sid}">' in page
    for why in ("no quantized artifact in the lineage", "not a mixture-of-experts model", "no eval-report",
                "no bench-report", "no per-position histogram"):
        assert f"not measured: {why}" in page
    assert "different models" not in page


def test_every_artifact_string_is_escaped(tmp_path):
    """HOSTILE (a script, an image with onerror, quotes, an entity) in every string an artifact or a server
    provides reaches the page only escaped, in the HTML and inside the figures."""
    store = Store(tmp_path / "store")
    arts = replay(store, hostile())
    page = _page(store, [arts[1], arts[3]], tmp_path)
    assert "<script" not in page
    assert "<img src=x" not in page
    assert "onerror=\"" not in page
    assert page.count(html.escape(HOSTILE)) >= 6   # commands, scheme, gates, eval names, coverage scheme
    for svg in _svgs(page):
        assert "<script" not in svg
        assert "<img" not in svg


def test_the_cli_writes_the_page_and_refuses_bad_input(recorded, tmp_path):
    store, (_, mixed, *_rest) = recorded
    run = CliRunner().invoke
    out = tmp_path / "x.html"
    ok = run(cli, ["--store", str(store.root), "report", mixed.ref, "--output", str(out)])
    assert ok.exit_code == 0, ok.output
    assert out.read_text().startswith("<!DOCTYPE html>"), ok.output
    for argv, message in ((["report", "no-such-artifact"], "no artifact 'no-such-artifact'"),
                          (["report", mixed.ref, "--output", str(tmp_path / "missing" / "r.html")],
                           "cannot write the report to"),
                          (["report", mixed.ref, "--output", " "], "--output is empty")):
        bad = run(cli, ["--store", str(store.root), *argv])
        assert bad.exit_code == 2, bad.output
        assert message in bad.output, bad.output
        assert "Traceback" not in bad.output, bad.output
    assert not list((tmp_path).glob(".*.tmp"))


def test_a_recipe_writes_the_report_as_its_last_stage(tmp_path, monkeypatch, tiny_model_dir):
    """`report:` in a recipe writes the page over what the stages before it made (here none: the model itself);
    --dry-run names the file without writing it; a misspelt key is refused naming it."""
    from llmq.errors import LlmqError
    from llmq.pipeline.recipe import load_recipe
    from llmq.pipeline.runner import run_recipe

    store = Store(tmp_path / "store")
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: tiny\nmodel: {tiny_model_dir}\nstages:\n  report: {{}}\n")
    dry = run_recipe(load_recipe(recipe), store, dry_run=True)
    assert [(r.stage, r.status, r.summary["path"]) for r in dry.stages] == [("report", "would run", "tiny-report.html")]
    assert not (tmp_path / "tiny-report.html").exists()
    res = run_recipe(load_recipe(recipe), store)
    assert res.stages[-1].summary["path"] == "tiny-report.html"
    page = (tmp_path / "tiny-report.html").read_text()
    assert res.model.ref in page
    assert "not measured: no quantized artifact in the lineage" in page
    recipe.write_text(f"name: tiny\nmodel: {tiny_model_dir}\nstages:\n  report: {{outptu: x.html}}\n")
    with pytest.raises(LlmqError, match="stages.report.outptu"):
        load_recipe(recipe)
