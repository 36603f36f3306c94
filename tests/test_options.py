"""Stage options are declared once: every stage's command-line flags and recipe keys are its options dataclass."""

import dataclasses
import typing

import click
import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from llmq.cli.main import cli
from llmq.errors import LlmqError
from llmq.options import default_of, flag_of, user_fields
from llmq.pipeline.recipe import STAGE_ORDER, STAGES, Stages
from llmq.runtime.config import EngineConfig, Limits, ServerOptions

COMMANDS = {"quantize": ("quantize",), "quantize_kv": ("quantize-kv",), "build": ("build",), "eval": ("eval",),
            "bench": ("bench", "offline"), "report": ("report",)}
COMMAND_ONLY = {"as_json"}  # output format, not a stage option


def _command(path: tuple[str, ...]) -> click.Command:
    cmd = cli
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def _recipe_stage(stage: str):
    return typing.get_args(Stages.model_fields[stage].annotation)[0]  # QuantizeStage | None -> QuantizeStage


def _values(f, hint) -> list:
    """Values other than the default to set a field to; every choice, where there are choices."""
    default = default_of(f)
    hint = (next(a for a in typing.get_args(hint) if a is not type(None)) if type(None) in typing.get_args(hint)
            else hint)
    if f.metadata["choices"]:
        return [c for c in f.metadata["choices"] if c != default]
    if hint is bool:
        return [not default]
    if typing.get_origin(hint) is list:
        return [["ppl", "kld"]] if typing.get_args(hint)[0] is str else [[3, 5]]
    low = next((v for k, v in f.metadata["bounds"].items() if k in ("ge", "gt")), 0)  # a value inside the bounds
    return {int: [3], float: [low + 0.25], str: ["x"]}[hint]


def _argv(opt: click.Option, value) -> list[str]:
    if opt.is_flag:
        return [opt.opts[0]] if value else opt.secondary_opts[:1]
    return [opt.opts[0], ",".join(map(str, value)) if isinstance(value, list) else str(value)]


def _from_cli(cmd: click.Command, cls, argv: list[str]):
    """The options the command builds from argv (what `stage_options` hands the command)."""
    params = cmd.make_context(cmd.name, list(argv)).params
    return cls(**{f.name: params[f.name] for f in user_fields(cls)})


@pytest.mark.parametrize("stage", STAGE_ORDER)
def test_cli_recipe_and_stage_options_agree(stage):
    """Walks every stage: the command's flags, the recipe stage's keys and the options dataclass's fields have the
    same names, help, choices and defaults; every setting, under its name or a former one, gives the same options
    from the command line as from a recipe, or the same refusal."""
    cls, cmd, recipe = STAGES[stage], _command(COMMANDS[stage]), _recipe_stage(stage)
    fields = {f.name: f for f in user_fields(cls)}
    hints = typing.get_type_hints(cls)
    options = [p for p in cmd.params if isinstance(p, click.Option)]
    shown = {p.name: p for p in options if not p.hidden}
    assert set(shown) - COMMAND_ONLY == set(fields) == set(recipe.model_fields)
    assert all(not a.required for a in cmd.params if isinstance(a, click.Argument))  # REF: the default model

    required = {n: f.metadata["choices"][0] for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    base = [a for n, v in required.items() for a in _argv(shown[n], v)]
    assert _from_cli(cmd, cls, base) == recipe.model_validate(required).to_options() == cls(**required)

    for name, f in fields.items():
        opt = shown[name]
        assert opt.opts[0] == ("--" + name.replace("_", "-") if f.metadata["flag"] is None
                               else f.metadata["flag"].split("/")[0])
        assert opt.help == f.metadata["help"]
        if isinstance(opt.type, click.Choice):
            assert tuple(opt.type.choices) == f.metadata["choices"]
        spellings = [p for p in options if p.name == name and p.opts[0] not in f.metadata["switches"]]
        assert len(spellings) == 1 + len(f.metadata["aliases"])
        for flag, value in f.metadata["switches"].items():
            assert getattr(_from_cli(cmd, cls, base + [flag]), name) == value
        for value in _values(f, hints[name]):
            from_cli = [_from_cli(cmd, cls, base + _argv(p, value)) for p in spellings]
            assert all(o == from_cli[0] for o in from_cli), (name, value)
            assert getattr(from_cli[0], name) == value, (name, value)
            for key in (name, *f.metadata["aliases"]):
                try:
                    keys = {k: v for k, v in required.items() if k != name} | {key: value}
                    from_recipe = recipe.model_validate(keys).to_options()
                except ValidationError as e:
                    with pytest.raises(LlmqError) as refused:
                        from_cli[0].check()
                    assert str(refused.value) in str(e), (key, value)
                else:
                    assert from_recipe == from_cli[0], (key, value)


def test_every_recipe_stage_has_its_command():
    assert set(COMMANDS) == set(STAGE_ORDER) == set(Stages.model_fields)


SERVE = (EngineConfig, ServerOptions, Limits)


def test_serve_flags_are_the_runtime_settings():
    """`llmq serve`'s flags are EngineConfig's, ServerOptions' and Limits' fields and nothing else: each under its
    declared flag with its help and choices, defaulting to the dataclass's default; every setting, under its flag or
    a former one, reaches the field."""
    cmd = _command(("serve",))
    options = [p for p in cmd.params if isinstance(p, click.Option)]
    shown = {p.name: p for p in options if not p.hidden}
    fields = {f.name: (cls, f) for cls in SERVE for f in user_fields(cls)}
    assert set(shown) == set(fields)
    assert {f.name for f in user_fields(EngineConfig)} >= {
        "max_num_seqs", "kv_cache_memory", "enable_prefix_caching", "speculative"}
    defaults = cmd.make_context("serve", []).params
    assert [cls(**{f.name: defaults[f.name] for f in user_fields(cls)}) for cls in SERVE] == [cls() for cls in SERVE]
    for name, (cls, f) in fields.items():
        opt = shown[name]
        assert (opt.opts[0], opt.help) == (flag_of(f), f.metadata["help"])
        assert defaults[name] == default_of(f)
        if f.metadata["choices"]:
            assert tuple(opt.type.choices) == f.metadata["choices"]
        spellings = [p for p in options if p.name == name]
        assert len(spellings) == 1 + len(f.metadata["aliases"])
        for value in _values(f, typing.get_type_hints(cls)[name]):
            for p in spellings:
                assert getattr(_from_cli(cmd, cls, _argv(p, value)), name) == value, (p.opts, value)
    # the spellings the flags have beyond their field names
    params = cmd.make_context("serve", ["--no-prefix-caching", "--kv", "fp8", "--max-seq-len", "9",
                                        "--max-body-size", "1KiB", "--kv-cache-memory", "2MiB"]).params
    assert (params["enable_prefix_caching"], params["kv_cache_dtype"], params["max_model_len"],
            params["max_body_bytes"], params["kv_cache_memory"]) == (False, "fp8", 9, 1024, 2 << 20)


@pytest.mark.parametrize("argv, message", [
    (["--max-batch-size", "0"], "--max-batch-size must be >= 1, got 0"),
    (["--kv-cache-fraction", "1.5"], "--kv-cache-fraction must be <= 1, got 1.5"),
    (["--kv-cache-memory", "1GiB", "--kv-cache-fraction", "0.5"], "give --kv-cache-memory or --kv-cache-fraction"),
    (["--kv-cache-memory", "lots"], "cannot read 'lots' as a size"),
    (["--num-speculative-tokens", "0"], "--num-speculative-tokens must be >= 1"),
    (["--max-queue", "-1"], "--max-queue must be >= 0, got -1"),
    (["--max-stop-length", "-1"], "--max-stop-length must be >= 0, got -1"),
    (["--keep-alive-timeout", "0"], "--keep-alive-timeout must be > 0"),
    (["--max-connections", "0"], "--max-connections must be >= 1"),
])
def test_serve_refuses_a_bad_setting_in_one_line_before_loading(tmp_path, argv, message):
    r = CliRunner().invoke(cli, ["--store", str(tmp_path), "serve", "no-such-model", *argv])
    assert r.exit_code == 2
    assert r.output.count("\n") == 1
    assert r.output.startswith("error: ")
    assert message in r.output


def test_code_that_builds_an_engine_config_gets_the_same_checks(tiny_model_dir):
    from llmq.runtime import LLMEngine

    for cfg, message in [(EngineConfig(block_size=0), "--block-size must be >= 1"),
                         (EngineConfig(kv_cache_dtype="int4"), "--kv 'int4': use one of auto, int8, fp8"),
                         (EngineConfig(speculative="ngram", speculative_max_batch=-1), "--speculative-max-batch")]:
        with pytest.raises(LlmqError, match=message):
            LLMEngine(tiny_model_dir, cfg)
    assert LLMEngine(tiny_model_dir, EngineConfig(kv_cache_fraction=0.01, device="cpu")).num_blocks >= 1
