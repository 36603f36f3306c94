"""Stage options, declared once.

Each stage's options are one frozen dataclass (QuantizeOptions, KVOptions, BuildOptions, EvalOptions, OfflineOptions)
whose fields carry their help text, choices, bounds and former names. The command line (`llmq.cli.options`) and the
recipe (`llmq.pipeline.recipe`) are both derived from it, so an option has one name everywhere: `--max-seq-len` on
the command line is `max_seq_len:` in a recipe and `BuildOptions.max_seq_len` in code. Options several stages share
are declared once and joined by inheritance or `add_fields` (DraftOptions: the runtime's and `llmq deploy`'s
speculative decoding). Imports nothing heavy: the CLI reads these classes before any command runs.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import typing

from .errors import LlmqError

BOUNDS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="), "lt": (operator.lt, "<")}
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_size(text: str) -> int:
    """'512MiB', '2GiB', '1.5GB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise LlmqError(f"cannot read {text!r} as a size; use e.g. 512MiB, 2GiB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    """parse_size's inverse for what --help shows: 8388608 -> '8MiB'."""
    for unit in ("tib", "gib", "mib", "kib"):
        if n and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit[0].upper()}iB"
    return str(n)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB': a size as people read it."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def option(default=dataclasses.MISSING, help: str = "", *, choices: tuple | None = None, aliases: tuple[str, ...] = (),
           flag: str | None = None, switches: dict | None = None, metavar: str | None = None,
           min_items: int | None = None, internal: bool = False, size: bool = False, envvar: str | None = None,
           **bounds):
    """A dataclass field that is a stage option.

    choices / bounds (ge, gt, le, lt; on every item of a list): the recipe's constraints, and check()'s, which every
    stage runs first (string choices are also the CLI's click.Choice); aliases: former names, still accepted as
    hidden flags and recipe keys; flag: the CLI spelling when it is not --NAME (e.g.
    "--sym/--asym", "--max-batch-size"); switches: hidden flags that set a value ({"--per-head": "head"}); internal:
    a knob for code and tests that is neither a flag nor a recipe key; size: an int of bytes that the command line
    spells as a size (parse_size); envvar: the environment variable the flag defaults to."""
    assert set(bounds) <= set(BOUNDS), bounds
    meta = {"help": help, "choices": choices, "aliases": aliases, "flag": flag, "switches": switches or {},
            "metavar": metavar, "min_items": min_items, "internal": internal, "size": size, "envvar": envvar,
            "bounds": bounds}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def add_fields(*parts: type):
    """Class decorator, under @dataclass: the fields of each options dataclass in `parts` join the class's own, after
    them, as if declared in its body. How a stage's options take options declared elsewhere (each quantize method's
    own) and still have one flag and one recipe key each."""
    def decorate(cls):
        for part in parts:
            hints = typing.get_type_hints(part)
            for f in dataclasses.fields(part):
                cls.__annotations__[f.name] = hints[f.name]
                setattr(cls, f.name, dataclasses.field(default=f.default, default_factory=f.default_factory,
                                                       metadata=f.metadata))
        return cls
    return decorate


def user_fields(cls) -> list[dataclasses.Field]:
    """The fields a user sets: every flag of the stage's command and every key of its recipe stage."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def default_of(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def flag_of(f: dataclasses.Field) -> str:
    """The command-line spelling of a field: its declared flag (the first of "--on/--off"), else --NAME."""
    return (f.metadata.get("flag") or "--" + f.name.replace("_", "-")).split("/")[0]


class Options:
    """Base of the stage options dataclasses. check() refuses values outside the declared choices and bounds;
    a stage adds its cross-field rules by extending it."""

    def check(self) -> None:
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            items = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
            if meta.get("min_items") and len(items) < meta["min_items"]:
                raise LlmqError(f"{flag_of(f)} needs at least {meta['min_items']} value(s)")
            for x in items:
                if meta.get("choices") and x not in meta["choices"]:
                    raise LlmqError(f"{flag_of(f)} {x!r}: use one of {', '.join(map(str, meta['choices']))}")
                for op, bound in meta.get("bounds", {}).items():
                    holds, sign = BOUNDS[op]
                    if not holds(x, bound):
                        raise LlmqError(f"{flag_of(f)} must be {sign} {bound}, got {x!r}")


# above this many running sequences speculation stops (a K-token draft multiplies a sequence's step compute by
# K+1); a starting point, not yet tuned: benchmarks/bench_speculative.py's concurrency sweep is the measurement to
# tune it
SPECULATIVE_MAX_BATCH = 8


def draft_artifact(ref: str, store):
    """The artifact a `--speculative REF` names (a model, quantized or engine artifact), through `store`."""
    from .models import source_artifact

    art = source_artifact(ref, store)
    if art.kind not in ("model", "quantized", "engine"):
        raise LlmqError(f"--speculative {ref} is a {art.kind} artifact; a draft model is a model, quantized or engine "
                        "artifact")
    return art


@dataclasses.dataclass(frozen=True)
class DraftOptions(Options):
    """What to speculate with: llmq's runtime (SpeculativeOptions) and `llmq deploy` (each engine's own speculative
    decoding) take these."""

    speculative: str | None = option(None, "Speculative decoding: ngram (prompt lookup, no model) or REF, a draft "
                                     "model with the target's tokenizer (e.g. the target's INT4 artifact).",
                                     metavar="ngram|REF")
    num_speculative_tokens: int = option(4, "Draft tokens per speculating sequence and step.", ge=1)


@dataclasses.dataclass(frozen=True)
class SpeculativeOptions(DraftOptions):
    """Speculative decoding in the bundled runtime: `llmq serve`, `llmq bench offline` and `llmq eval` take these
    (lossless, so eval scores and greedy outputs are those without it)."""

    speculative_max_batch: int = option(SPECULATIVE_MAX_BATCH, "Back off under load: no drafts while more sequences "
                                        "than this are running (large batches are compute bound).", ge=0)

    def engine_fields(self, store) -> dict:
        """EngineConfig's speculative fields, a draft REF resolved to its artifact's path (through `store`)."""
        spec = self.speculative
        if spec not in (None, "ngram"):
            spec = str(draft_artifact(spec, store).path)
        return {"speculative": spec, "num_speculative_tokens": self.num_speculative_tokens,
                "speculative_max_batch": self.speculative_max_batch}
