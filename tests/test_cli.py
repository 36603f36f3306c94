import json
import os
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import click
from click.testing import CliRunner

from llmq.cli.main import cli

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ("quantize", "quantize-kv", "build", "eval", "serve", "bench", "run", "ls", "inspect", "lineage", "import",
            "verify")


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
    assert [a["ref"] for a in ls] == ["tiny/v1"]
    assert ls[0]["kind"] == "model"
    man = json.loads(run(store, "inspect", "tiny", "--json").output)
    assert man["config"]["architecture"]["num_kv_heads"] == 2
    assert "model.safetensors" in man["files"]
    human = run(store, "inspect", "tiny/v1").output
    assert "num_kv_heads" in human
    assert "model.safetensors" in human
    lin = run(store, "lineage", "tiny").output
    assert "tiny/v1 [model]" in lin
    assert "hf-dir" in lin


def test_errors_are_one_line_with_exit_code_2(tmp_path, tiny_model_dir):
    store = tmp_path / "store"
    r = run(store, "inspect", "nope")
    assert r.exit_code == 2
    assert r.output.count("\n") == 1
    assert r.output.startswith("error: no artifact 'nope'")
    run(store, "import", str(tiny_model_dir))
    f = store / "tiny" / "v1" / "config.json"
    os.chmod(f, 0o644)
    f.write_text(f.read_text().replace("64", "65", 1))
    r = run(store, "inspect", "tiny")
    assert r.exit_code == 2
    assert "config.json" in r.output
    assert "Traceback" not in r.output


def test_verify_rehashes_everything_and_names_a_damaged_file(tmp_path):
    from llmq.artifacts import Store

    store = Store(tmp_path / "store")
    with store.create("model", "thing") as w:
        (w.dir / "a.bin").write_bytes(b"hello")
        (w.dir / "b.txt").write_text("more")
        for p in (w.dir / "a.bin", w.dir / "b.txt"):
            os.utime(p, ns=(0, 10**18))  # long settled: the write stamps them, loads read nothing
    r = run(store.root, "verify", "thing")
    assert r.exit_code == 0, r.output
    assert r.output == f"OK thing/v1 {w.artifact.id[:12]}: 2 files, 9 B re-hashed\n", r.output
    f = store.root / "thing" / "v1" / "a.bin"
    os.chmod(f, 0o644)
    f.write_bytes(b"jello")
    os.utime(f, ns=(0, 10**18))  # size and mtime as stamped: a load does not see it, verify does
    assert run(store.root, "inspect", "thing").exit_code == 0
    r = run(store.root, "verify", "thing/v1")
    assert r.exit_code == 2
    assert r.output == "error: artifact thing/v1 is damaged: file a.bin does not match its sha256\n"
    assert run(store.root, "verify", "nope").exit_code == 2


def _edit_manifest(path, edit):
    m = json.loads(path.read_text())
    edit(m)
    os.chmod(path, 0o644)
    path.write_text(json.dumps(m))


def test_forged_manifests_fail_inspect_and_lineage_in_one_line(tmp_path):
    from llmq.artifacts import Store

    store = Store(tmp_path / "store")
    arts = {}
    for name, parents in (("src", []), ("real", None), ("fake", None)):
        with store.create("model", name, parents=parents if parents is not None else [arts["src"].id],
                          config={"bits": 4}) as w:
            (w.dir / "a.bin").write_bytes(name.encode())
            w.metrics["kld"] = 0.3
        arts[name] = w.artifact
    man = arts["real"].path / "llmq.json"
    for forge in (lambda m: m["metrics"].update(kld=0.0), lambda m: m["config"].update(bits=8),
                  lambda m: m.update(parents=[arts["fake"].id])):
        _edit_manifest(man, forge)
        for cmd in ("inspect", "lineage"):
            r = run(store.root, cmd, "real")
            assert r.exit_code == 2, r.output
            assert r.output.count("\n") == 1, r.output
            assert r.output.startswith("error: ")
            assert "real/v1/llmq.json: manifest was edited" in r.output
        man.write_text(json.dumps(arts["real"].manifest))  # undo: the manifest as written, reformatted
    assert run(store.root, "inspect", "real").exit_code == 0


def test_ls_lists_a_malformed_manifest_as_damaged_and_goes_on(tmp_path, tiny_model_dir):
    store = tmp_path / "store"
    assert run(store, "import", str(tiny_model_dir)).exit_code == 0
    from llmq.artifacts import Store

    with Store(store).create("model", "other") as w:
        (w.dir / "a.bin").write_bytes(b"x")
    _edit_manifest(store / "tiny" / "v1" / "llmq.json", lambda m: m.update(files=list(m["files"])))
    r = run(store, "ls")
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output, r.output
    assert "other/v1" in r.output
    assert "DAMAGED" in r.output
    assert "damaged: tiny/v1: " in r.output
    listed = json.loads(run(store, "ls", "--json").stdout)
    assert [(a["ref"], "damaged" in a) for a in listed] == [("other/v1", False), ("tiny/v1", True)]
    r = run(store, "inspect", "tiny/v1")
    assert r.exit_code == 2
    assert r.output.count("\n") == 1
    assert "tiny/v1/llmq.json: manifest is malformed" in r.output


def test_import_refuses_a_malicious_pickle_in_one_line(tmp_path, tiny_model_dir):
    import torch

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (tiny_model_dir / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": Payload()}, tiny_model_dir / "pytorch_model.bin")
    r = run(tmp_path / "store", "import", str(tiny_model_dir), "--allow-pickle")
    assert r.exit_code == 2, r.output
    assert r.output.count("\n") == 1, r.output
    assert "Traceback" not in r.output, r.output
    assert r.output.startswith("error: ")
    assert "pytorch_model.bin: refused" in r.output
    assert "posix.system" in r.output
    assert not marker.exists()


def _commands(group: click.Group, path=()):
    for name, cmd in group.commands.items():
        yield (*path, name), cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*path, name))


def test_help_imports_nothing_heavy():
    """`llmq --help` and every `llmq CMD --help` load neither torch nor transformers (measured as imports, not time)."""
    code = textwrap.dedent("""
        import sys
        import click
        from click.testing import CliRunner
        from llmq.cli.main import cli

        def walk(group, path=()):
            yield path
            for name, cmd in group.commands.items():
                yield from walk(cmd, (*path, name)) if isinstance(cmd, click.Group) else [(*path, name)]

        for path in walk(cli):
            r = CliRunner().invoke(cli, [*path, "--help"])
            assert r.exit_code == 0 and "Usage: " in r.output, (path, r.output)
        print(sorted(m for m in ("torch", "transformers", "lm_eval", "numpy") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_an_option_has_one_name_across_commands():
    flags = defaultdict(set)
    for _, cmd in _commands(cli):
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden:
                flags[p.name].add(p.opts[0])
    assert {name: f for name, f in flags.items() if len(f) > 1} == {}
    serve = cli.commands["serve"]  # the spellings serve had before it took build's names still work
    argv = ["--kv-cache-dtype", "fp8", "--max-num-seqs", "3", "--max-model-len", "9"]
    params = serve.make_context("serve", argv).params
    assert (params["kv_cache_dtype"], params["max_num_seqs"], params["max_model_len"]) == ("fp8", 3, 9)


def test_bench_subcommands_and_the_spellings_before_them():
    from llmq.cli.bench import _subcommand_for

    assert set(cli.commands["bench"].commands) == {"serve", "offline", "hw", "compare"}
    assert _subcommand_for(["--engine", "m", "--batch-sizes", "1,2"]) == ["offline", "m", "--batch-sizes", "1,2"]
    assert _subcommand_for(["--json", "--engine=m"]) == ["offline", "m", "--json"]
    assert _subcommand_for(["--hw", "--refresh"]) == ["hw", "--refresh"]
    assert _subcommand_for(["--endpoint", "u", "--no-save"]) == ["serve", "--endpoint", "u", "--no-save"]


def test_ls_refuses_an_unknown_kind_listing_the_kinds(tmp_path):
    r = run(tmp_path / "store", "ls", "--kind", "modle")
    assert r.exit_code == 2
    assert all(k in r.output for k in ("model", "quantized", "engine", "eval-report"))
