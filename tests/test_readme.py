"""README.md and docs/*.md against the code: every command they show is checked, so the docs cannot rot.

What is checked (the whole module takes a few seconds; no test here loads the default model):

- Every `llmq ...` command, in fenced or indented code blocks and in inline code spans, also where it follows other
  commands on one line (`... && llmq run recipes/quickstart.yaml`), is parsed by the real click command line:
  unknown options, bad choices, wrong types and missing required options fail. For the stage commands (quantize,
  quantize-kv, build, eval, bench offline) the parsed options also go through the stage's own `check()`, the rules
  a stage applies before it loads a model; `llmq run RECIPE` loads and validates the recipe file. An inline span
  that only names a command (`llmq run` in a sentence) may leave out its required arguments, nothing else.
  These are option-parsing checks only: running the stages takes minutes on the default model, and some commands
  need a network (hub ids), a GPU, tensorrt_llm or a running server. The main job itself, `llmq run
  recipes/quickstart.yaml`, runs end to end in tests/test_recipe.py (marked integration; with 8 calibration windows
  of 128 tokens and 10 items a task, its other settings the shipped ones).
- The store commands (`llmq ls`, `inspect`, `lineage`, `verify`) are run for real, against a store that holds a tiny
  random model and its INT4 artifact, their artifact references replaced by that artifact's name.
- Every `python benchmarks/X.py ...` command is parsed by that script's own argparse parser (the script runs up to
  its `parse_args()` call and no further).
- Every YAML block with `stages:` loads as a recipe; every relative link points at a file and, with `#anchor`, at
  one of its headings; the README stays a front door (at most ~200 lines) and its `## Supported models` table names
  exactly the architectures llmq accepts.

Not checked: pip, docker and curl lines and the Python client snippet (tests/test_server.py drives the same API
with the openai client; tests/test_dockerfile.py checks the image installs what the README installs).
"""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200
STORE_COMMANDS = ("ls", "inspect", "lineage", "verify")
CONTROL = {"&&", "||", ";", "|", "&", "(", ")"}


def test_ci_runs_the_readme_test_command():
    readme = README.read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line.strip() for line in ci.splitlines() if "python3 -m venv" in line and not line.startswith("#"))
    assert f"    {command}\n" in readme
    assert (readme.index("Set up and run the main job") < readme.index("Set up and pass the tests")
            < readme.index(command))


# --- finding the commands ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Command:
    page: str
    line: int
    argv: tuple[str, ...]   # from the program name on: ("llmq", "quantize", ...) or ("python", "benchmarks/x.py", ...)
    inline: bool = False    # an inline code span in prose: may name a command without its required arguments

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {shlex.join(self.argv)}"


def _blocks(text: str):
    """(first line number, language, lines) of every fenced and indented code block; then the prose."""
    lines = text.splitlines()
    prose, i = [], 0
    prev_blank = True
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^(\s*)(```+|~~~+)\s*([\w+-]*)", line)
        if fence:
            close, lang, start, body = fence.group(2), fence.group(3).lower(), i + 2, []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(close):
                body.append(lines[i])
                i += 1
            yield start, lang, body
            i += 1
            prev_blank = False
            continue
        if line.startswith("    ") and prev_blank and line.strip():
            start, body = i + 1, []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i][4:])
                i += 1
            yield start, "", body
            prev_blank = False
            continue
        prose.append((i + 1, line))
        prev_blank = not line.strip()
        i += 1
    yield None, "prose", prose


def _segments(source: str) -> list[list[str]]:
    """The simple commands of one shell line: split at && || ; | &, comments dropped, leading VAR=x dropped."""
    lex = shlex.shlex(source, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    out, cur = [], []
    for tok in lex:
        if tok in CONTROL:
            out.append(cur)
            cur = []
        else:
            cur.append(tok)
    out.append(cur)
    segments = []
    for seg in out:
        while seg and re.fullmatch(r"[A-Za-z_]\w*=.*", seg[0]):
            seg = seg[1:]
        if seg:
            segments.append(seg)
    return segments


def _wanted(seg: list[str]) -> bool:
    return seg[0] == "llmq" and len(seg) > 1 or (
        seg[0] in ("python", "python3") and len(seg) > 1 and seg[1].startswith("benchmarks/"))


def _commands_of(path: Path) -> list[Command]:
    page = str(path.relative_to(ROOT))
    found = []
    for start, lang, body in _blocks(path.read_text()):
        if lang == "prose":   # inline code spans that are commands, possibly wrapped over two lines
            text = "\n".join(line for _, line in body)
            numbers = [n for n, _ in body]
            for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text):
                span = " ".join(m.group(1).split())
                if span.startswith(("llmq ", "python benchmarks/", "python3 benchmarks/")):
                    line = numbers[text.count("\n", 0, m.start())]
                    found += [Command(page, line, tuple(s), True) for s in _segments(span) if _wanted(s)]
            continue
        if lang not in ("", "bash", "sh", "shell", "console"):
            continue
        logical, first = "", None
        for k, raw in enumerate(body):
            raw = raw.removeprefix("$ ") if lang == "console" else raw
            first = start + k if first is None else first
            if raw.rstrip().endswith("\\"):
                logical += raw.rstrip()[:-1] + " "
                continue
            logical += raw
            found += [Command(page, first, tuple(s)) for s in _segments(logical) if _wanted(s)]
            logical, first = "", None
    return found


COMMANDS = [c for p in PAGES for c in _commands_of(p)]
LLMQ = [c for c in COMMANDS if c.argv[0] == "llmq"]
BENCHMARKS = [c for c in COMMANDS if c.argv[0] != "llmq"]


def test_every_page_is_found_and_has_commands():
    assert (ROOT / "docs").is_dir()
    for page in PAGES:
        if page.name != "extending.md":   # prose about the code; the rest show how to run things
            assert any(c.page == str(page.relative_to(ROOT)) for c in COMMANDS), f"no command found in {page}"


# --- llmq commands: the real parser and each stage's own checks ------------------------------------------------

def _parse(argv: list[str]) -> tuple[click.Command, click.Context]:
    """The leaf command and its context, as `llmq ARGV` would build them, without running anything."""
    from llmq.cli.main import cli

    ctx = cli.make_context("llmq", list(argv))
    cmd = cli
    while isinstance(cmd, click.Group):
        rest = ([*ctx._protected_args, *ctx.args] if hasattr(ctx, "_protected_args")
                else [*ctx.protected_args, *ctx.args])
        if not rest:
            break
        name, cmd, rest = cmd.resolve_command(ctx, rest)
        ctx = cmd.make_context(name, rest, parent=ctx)
    return cmd, ctx


def _option_classes():
    """Every stage's options dataclass (llmq.options.Options subclasses)."""
    import llmq.cli.main  # noqa: F401  (imports every stage's options)
    from llmq.options import Options

    todo, seen = [Options], []
    while todo:
        for sub in todo.pop().__subclasses__():
            seen.append(sub)
            todo.append(sub)
    return seen


def _stage_check(ctx: click.Context) -> list[str]:
    """Run check() of every options class whose fields the command took; the names of those checked."""
    from llmq.options import user_fields

    checked = []
    for cls in _option_classes():
        names = [f.name for f in user_fields(cls)]
        if names and all(n in ctx.params for n in names):
            cls(**{n: ctx.params[n] for n in names}).check()
            checked.append(cls.__name__)
    return checked


@pytest.mark.parametrize("command", LLMQ, ids=str)
def test_llmq_command_parses_and_passes_the_stage_checks(command):
    try:
        cmd, ctx = _parse(list(command.argv[1:]))
    except click.exceptions.Exit as e:   # --help
        assert e.exit_code == 0, command
        return
    except click.MissingParameter as e:
        if not command.inline:
            pytest.fail(f"{command}\n  is refused by the command line: {e.format_message()}")
        return   # `llmq run` in a sentence names the command; its options, where given, were parsed
    except click.UsageError as e:
        pytest.fail(f"{command}\n  is refused by the command line: {e.format_message()}")
    path = ctx.command_path.split()[1:]
    if path[:1] == ["run"]:
        from llmq.pipeline.recipe import load_recipe

        recipe = ROOT / ctx.params["recipe"]
        assert recipe.is_file(), f"{command}: no recipe {recipe}"
        load_recipe(recipe)
        return
    checked = _stage_check(ctx)
    stages = {"quantize": "QuantizeOptions", "quantize-kv": "KVOptions", "build": "BuildOptions", "eval": "EvalOptions",
              "offline": "OfflineOptions"}
    if path[-1] in stages:
        assert stages[path[-1]] in checked, f"{command}: {stages[path[-1]]} was not checked ({checked})"


def test_commands_cover_every_stage_and_subcommand():
    """The docs show every command llmq has (a new command needs its page)."""
    from llmq.cli.main import cli

    def path(argv):
        words, cmd = [], cli
        for word in (w for w in argv if not w.startswith("-")):
            if not isinstance(cmd, click.Group) or word not in cmd.commands:
                break
            words.append(word)
            cmd = cmd.commands[word]
        return " ".join(words)

    shown = {path(c.argv[1:]) for c in LLMQ}
    have = set()
    for name, cmd in cli.commands.items():
        if isinstance(cmd, click.Group):  # a hidden subcommand is the group's default (`llmq deploy REF`)
            have |= {f"{name} {sub}" if not c.hidden else name for sub, c in cmd.commands.items()}
        else:
            have.add(name)
    assert have <= shown, f"commands no page shows: {sorted(have - shown)}"


# --- store commands: run for real on a tiny artifact ------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory, tiny_model):
    from llmq.artifacts import Store
    from llmq.models import resolve_model
    from llmq.pipeline.quantize import QuantizeOptions, quantize

    root = tmp_path_factory.mktemp("docs")
    store = Store(root / "store")
    model = resolve_model(str(tiny_model()), store)
    art = quantize(model, QuantizeOptions(bits=4, group_size=32, probe_tokens=0, num_samples=2, seq_len=16), store,
                   progress=False)
    return store, art


def _subcommand(argv) -> str:
    """The command `llmq [--store DIR] NAME ...` runs."""
    rest = list(argv[1:])
    while rest and rest[0].startswith("-"):
        rest = rest[2:]
    return rest[0] if rest else ""


STORE_RUNS = [c for c in LLMQ if not c.inline and _subcommand(c.argv) in STORE_COMMANDS and "--help" not in c.argv]


@pytest.mark.parametrize("command", STORE_RUNS, ids=str)
def test_store_command_runs(command, tiny_store):
    from click.testing import CliRunner

    from llmq.cli.main import cli

    store, art = tiny_store
    argv, out = list(command.argv[1:]), []
    while argv:
        word = argv.pop(0)
        if word == "--store":
            argv.pop(0)
        elif word.startswith("-") or word in STORE_COMMANDS or word in ("quantized", "model"):
            out.append(word)
        else:   # an artifact reference: the tiny artifact, keeping a /vN
            out.append(art.name + (word[word.index("/v"):] if "/v" in word else ""))
    result = CliRunner().invoke(cli, ["--store", str(store.root), *out])
    assert result.exit_code == 0, f"{command}\n  ran as llmq {shlex.join(out)}: {result.output}"


# --- benchmark scripts: their own argparse parser ---------------------------------------------------------------

class _Parsed(Exception):
    pass


@pytest.mark.parametrize("command", BENCHMARKS, ids=str)
def test_benchmark_command_parses(command, monkeypatch, capsys):
    script = ROOT / command.argv[1]
    assert script.is_file(), f"{command}: no script {script}"
    real = argparse.ArgumentParser.parse_args

    def parse_and_stop(self, args=None, namespace=None):
        real(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    monkeypatch.setattr(sys, "argv", [str(script), *command.argv[2:]])
    monkeypatch.setattr(sys, "path", [str(script.parent), *sys.path])   # restored after, with what the script adds
    with pytest.raises(_Parsed):
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as e:
            pytest.fail(f"{command}\n  is refused by the script's parser: {capsys.readouterr().err.strip()} ({e})")


# --- recipes, links, the front door -----------------------------------------------------------------------------

def _yaml_blocks():
    for page in PAGES:
        for start, lang, body in _blocks(page.read_text()):
            if lang in ("yaml", "yml"):
                yield f"{page.relative_to(ROOT)}:{start}", "\n".join(body)


def _recipe_blocks():
    return [(where, text) for where, text in _yaml_blocks()
            if isinstance(data := yaml.safe_load(text), dict) and "stages" in data]


@pytest.mark.parametrize("where,text", _recipe_blocks(), ids=[w for w, _ in _recipe_blocks()])
def test_recipe_blocks_are_valid_recipes(where, text, tmp_path):
    from llmq.pipeline.recipe import load_recipe

    (tmp_path / "r.yaml").write_text(text)
    recipe = load_recipe(tmp_path / "r.yaml")
    assert recipe.name == yaml.safe_load(text)["name"], where


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", path.read_text(), re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"^[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        assert dest.exists(), f"{page.relative_to(ROOT)}: link to a missing {target}"
        if anchor:
            assert anchor in _anchors(dest), f"{page.relative_to(ROOT)}: no heading #{anchor} in {dest.name}"


def test_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, "README.md is the front door; details go to docs/"
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in text, f"README.md does not link docs/{page.name}"


def test_supported_models_table_names_what_llmq_accepts():
    from llmq.models import SUPPORTED_ARCHITECTURES

    text = README.read_text()
    section = text[text.index("\n## Supported models\n"):]
    section = section[:section.find("\n## ", 1)]
    listed = set(re.findall(r"^\|\s*`?(\w+ForCausalLM)`?", section, re.M))
    assert listed == set(SUPPORTED_ARCHITECTURES.values())
