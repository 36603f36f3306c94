"""Every refusal names only options of the command that printed it (issue 55): an option of another command is
quoted as that command (`llmq quantize --sym`), another program's flag as that program (`llama-server --split-mode`).

Two walks: refusals reached through the command line (the message must be the expected one and name only options
the printing command's parser has), and every error raised in a module that only one command reaches, read from the
source."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner
from helpers import free_port, make_tiny_model

from llmq.cli.main import cli

ROOT = Path(__file__).resolve().parents[1]
OPTION = re.compile(r"(?<![\w`/-])--[a-z][a-z0-9-]*")
QUOTED = re.compile(r"`([^`]*)`")


def command_options(path: str) -> set[str]:
    """Every spelling of every option of `llmq PATH` (e.g. "deploy write"), with the group's own (--store)."""
    options = {o for p in cli.params for o in (*p.opts, *getattr(p, "secondary_opts", ()))}
    cmd: click.Command = cli
    for word in path.split():
        assert isinstance(cmd, click.Group), f"no command llmq {path}"
        assert word in cmd.commands, f"no command llmq {path}"
        cmd = cmd.commands[word]
    return options | {o for p in cmd.params for o in (*p.opts, *getattr(p, "secondary_opts", ()))} | {"--help"}


def _quoted_command(text: str) -> str | None:
    """The llmq command a quoted `llmq ...` line runs ("build", "deploy verify"), None for another program's."""
    words = text.split()
    if not words or words[0] != "llmq":
        return None
    path: list[str] = []
    cmd: click.Command = cli
    for w in words[1:]:
        if not isinstance(cmd, click.Group) or w not in cmd.commands:
            break
        cmd, path = cmd.commands[w], [*path, w]
    if isinstance(cmd, click.Group) and "write" in cmd.commands:   # `llmq deploy REF ...` is `deploy write`
        path.append("write")
    return " ".join(path)


def foreign_options(message: str, command: str) -> list[str]:
    """The options `message`, printed by `llmq COMMAND`, names that are not that command's (those in a quoted
    `llmq OTHER ...` checked against OTHER; a quoted other program's flags are its own)."""
    bad = [o for o in OPTION.findall(QUOTED.sub(" ", message)) if o not in command_options(command)]
    for quoted in QUOTED.findall(message):
        other = _quoted_command(quoted)
        if other:
            bad += [f"{o} (of `llmq {other}`)" for o in OPTION.findall(quoted) if o not in command_options(other)]
    return bad


def test_the_check_itself_tells_own_options_from_foreign_ones():
    assert foreign_options("--tp 2 does not divide ...; drop --no-pad-heads", "build") == []
    assert foreign_options("--gpus-per-node 8: drop --no-pad-heads", "deploy write") == ["--no-pad-heads"]
    assert foreign_options("re-quantize (`llmq quantize --sym`)", "build") == []
    assert foreign_options("re-quantize (`llmq quantize --no-such`)", "build") == ["--no-such (of `llmq quantize`)"]
    assert foreign_options("(`llama-server --split-mode`)", "build") == []
    assert foreign_options("re-quantize with --sym", "build") == ["--sym"]
    assert foreign_options("point --store elsewhere", "eval") == []   # the group's own option, every command's


@pytest.fixture(scope="module")
def nine_heads(tmp_path_factory):
    """SmolLM2's head counts (9 query / 3 KV heads) at hidden 72, and a pickle-only copy of it."""
    d = tmp_path_factory.mktemp("msg")
    path = make_tiny_model(d / "nine", num_attention_heads=9, num_key_value_heads=3, hidden_size=72)
    pickled = make_tiny_model(d / "pickled")
    from safetensors.torch import load_file

    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    return {"MODEL": str(path), "PICKLED": str(pickled), "STORE": str(d / "store")}


# (command, its arguments, what the refusal says): MODEL is the 9-head model, PICKLED its pickle-only sibling
REFUSALS = [
    ("deploy write", ["MODEL", "--engine", "vllm", "--gpus-per-node", "8", "--nodes", "1"],
     "tp 8 does not divide this model's 9 attention heads"),
    ("deploy write", ["MODEL", "--engine", "sglang", "--gpus-per-node", "2", "--nodes", "1"],
     "tp 2 does not divide this model's 9 attention heads"),
    ("build", ["MODEL", "--tp", "2", "--no-pad-heads"], "drop --no-pad-heads to add zero heads (exact, 12 heads"),
    ("build", ["MODEL", "--tp", "2", "--pp", "2"], "pipeline parallelism is not supported"),
    ("build", ["MODEL", "--kv", "int8"], "`llmq quantize-kv REF --kv int8`"),
    ("build", ["MODEL", "--target", "gguf", "--tp", "4"], "use --tp 1, not --tp 4"),
    ("serve", ["MODEL", "--tp", "3", "--port", "PORT"], "tp 3 is not supported"),
    ("quantize", ["MODEL", "--method", "gptq", "--per-tensor"], "drop --per-tensor"),
    ("quantize", ["MODEL", "--method", "nvfp4", "--act-order"], "add --gptq"),
    ("quantize", ["PICKLED"], "`llmq import PATH --allow-pickle`"),
    ("quantize-kv", ["PICKLED"], "`llmq import PATH --allow-pickle`"),
    ("eval", ["MODEL", "--tasks", "kld", "--limit", "2"], "pass --baseline REF"),
    ("eval", ["MODEL", "--endpoint", "http://127.0.0.1:9"], "give REF or --endpoint URL, not both"),
    ("bench offline", ["MODEL", "--batch-sizes", "0"], "--batch-sizes must be >= 1"),
    ("bench serve", ["--endpoint", "http://127.0.0.1:9", "--num-prompts", "0"], "--num-prompts must be >= 1"),
]


@pytest.mark.parametrize("command,args,says", REFUSALS, ids=[f"{c}-{' '.join(a[1:3])}" for c, a, _ in REFUSALS])
def test_a_refusal_names_only_its_own_commands_options(nine_heads, command, args, says):
    places = {**nine_heads, "PORT": str(free_port())}
    argv = ["--store", places["STORE"], *command.split(), *(places.get(a, a) for a in args)]
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 2, (r.output, r.exception)
    message = r.output.strip().splitlines()[-1]
    assert message.startswith("error: "), message
    assert says in message, message
    assert foreign_options(message, command) == [], message


# modules that one command alone reaches -> that command
ONLY_FROM = {"llmq/pipeline/quantize/": "quantize", "llmq/pipeline/kvcache.py": "quantize-kv",
             "llmq/pipeline/targets/": "build", "llmq/pipeline/deploy/": "deploy write",
             "llmq/bench/online.py": "bench serve", "llmq/bench/offline.py": "bench offline",
             "llmq/cli/eval.py": "eval", "llmq/cli/serve.py": "serve", "llmq/runtime/server/": "serve",
             "llmq/cli/build.py": "build", "llmq/cli/quantize.py": "quantize", "llmq/cli/deploy.py": "deploy write"}


def _text(node) -> str:
    """A message's literal text ({} where an f-string formats a value)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(v) for v in node.values)
    if isinstance(node, ast.BinOp):
        return _text(node.left) + _text(node.right)
    return "{}"


def raised_messages(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every error constructed in `path` (a call of a name ending in Error or Failed) and of every
    module-level table of refusals (a constant named *REFUSED*)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.endswith(("Error",
                                                                                                     "Failed")):
            out.append((node.lineno, " ".join(_text(a) for a in node.args)))
        elif isinstance(node, ast.Assign) and any("REFUSED" in getattr(t, "id", "") for t in node.targets):
            out += [(c.lineno, _text(c)) for c in ast.walk(node.value) if isinstance(c, (ast.Constant, ast.JoinedStr))]
    return out


def test_errors_of_one_commands_modules_name_only_its_options():
    checked, bad = 0, []
    for prefix, command in ONLY_FROM.items():
        files = sorted((ROOT / prefix).rglob("*.py")) if prefix.endswith("/") else [ROOT / prefix]
        assert files, prefix
        for f in files:
            for line, message in raised_messages(f):
                checked += 1
                bad += [f"{f.relative_to(ROOT)}:{line} ({command}): {o}" for o in foreign_options(message, command)]
    assert checked > 100   # the walk reached the refusals (a moved module would otherwise check nothing)
    assert bad == [], "\n".join(bad)


def test_deploy_verify_of_a_root_model_asks_to_drop_kld_not_for_a_baseline_it_cannot_take(nine_heads):
    from llmq.artifacts import Store
    from llmq.errors import LlmqError
    from llmq.evals.deployed import verify_deployment
    from llmq.evals.runner import EvalSettings
    from llmq.models import resolve_model

    store = Store(nine_heads["STORE"])
    model = resolve_model(nine_heads["MODEL"], store)   # a model artifact: no lineage, so no baseline
    with pytest.raises(LlmqError, match="it has none: drop kld from --tasks$") as e:
        verify_deployment(store, model, None, EvalSettings(tasks=["kld"], kld=True), [])
    assert foreign_options(str(e.value), "deploy verify") == []
