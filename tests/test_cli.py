import json
import os

from click.testing import CliRunner

from llmq.cli.main import cli

PIPELINE = ("quantize", "quantize-kv", "build", "eval", "serve", "bench", "run", "ls", "inspect", "lineage", "import")


def run(store, *args):
    return CliRunner().invoke(cli, ["--store", str(store), *args])


def test_help_lists_every_subcommand():
    out = CliRunner().invoke(cli, ["--help"]).output
    for name in PIPELINE:
        assert f"  {name} " in out, name


def test_import_ls_inspect_lineage(tmp_path, tiny_model_dir):
    store = tmp_path / "store"
    r = run(store, "import", str(tiny_model_dir))
    assert r.exit_code == 0, r.output
    assert r.output.startswith("tiny/v1 ")
    ls = json.loads(run(store, "ls", "--json").output)
    assert [a["ref"] for a in ls] == ["tiny/v1"] and ls[0]["kind"] == "model"
    man = json.loads(run(store, "inspect", "tiny", "--json").output)
    assert man["config"]["architecture"]["num_kv_heads"] == 2 and "model.safetensors" in man["files"]
    human = run(store, "inspect", "tiny/v1").output
    assert "num_kv_heads" in human and "model.safetensors" in human
    lin = run(store, "lineage", "tiny").output
    assert "tiny/v1 [model]" in lin and "hf-dir" in lin


def test_errors_are_one_line_with_exit_code_2(tmp_path, tiny_model_dir):
    store = tmp_path / "store"
    r = run(store, "inspect", "nope")
    assert r.exit_code == 2 and r.output.count("\n") == 1 and r.output.startswith("error: no artifact 'nope'")
    run(store, "import", str(tiny_model_dir))
    f = store / "tiny" / "v1" / "config.json"
    os.chmod(f, 0o644)
    f.write_text(f.read_text().replace("64", "65", 1))
    r = run(store, "inspect", "tiny")
    assert r.exit_code == 2 and "config.json" in r.output and "Traceback" not in r.output
