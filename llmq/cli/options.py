"""Click options derived from a stage's options dataclass (`llmq.options`): same names, help, choices and defaults."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing

import click

from ..options import default_of, flag_of, format_size, parse_size, user_fields


class CommaList(click.ParamType):
    """`1,2,4` -> [1, 2, 4]: how the command line spells a list option."""

    def __init__(self, item: type):
        self.item = item
        self.name = f"{item.__name__},..."

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            return [self.item(x.strip()) for x in value.split(",") if x.strip()]
        except ValueError:
            self.fail(f"expected comma-separated {self.item.__name__} values, got {value!r}", param, ctx)


class Size(click.ParamType):
    """`512MiB` -> 536870912 bytes; an unreadable size is parse_size's one-line error."""

    name = "size"

    def convert(self, value, param, ctx):
        return value if isinstance(value, int) else parse_size(value)


def _base(hint):
    """int | None -> int; list[int] stays list[int]."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _params(f, hint) -> list[tuple[tuple, dict]]:
    """(declarations, attributes) of the click options of one field: its flag, then its hidden former spellings."""
    meta, default, kind = f.metadata, default_of(f), _base(hint)
    dash = f.name.replace("_", "-")
    if kind is bool:
        shown = meta["flag"] or (f"--{dash}/--no-{dash}" if default else flag_of(f))
        params = [((shown, f.name), dict(is_flag=True, default=default, show_default=bool(default)))]
        hidden = []  # no boolean option has a former name
    else:
        if meta["choices"] and all(isinstance(c, str) for c in meta["choices"]):
            typ = click.Choice(meta["choices"])
        elif meta["size"]:
            typ = Size()
        elif typing.get_origin(kind) is list:
            typ = CommaList(typing.get_args(kind)[0])
        else:
            typ = kind
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if isinstance(default, list):
            default = ",".join(map(str, default))  # shown as typed; CommaList parses it
        elif meta["size"] and default is not None:
            default = format_size(default)  # shown as typed; Size parses it
        params = [((flag_of(f), f.name), dict(type=typ, default=default, required=required,
                                              show_default=default is not None, metavar=meta["metavar"],
                                              envvar=meta["envvar"]))]
        hidden = [(f"--{a.replace('_', '-')}", dict(type=typ)) for a in meta["aliases"]]
    params[0][1]["help"] = meta["help"]
    params += [((decl, f.name), dict(attrs, hidden=True)) for decl, attrs in hidden]
    params += [((decl, f.name), dict(flag_value=value, hidden=True)) for decl, value in meta["switches"].items()]
    return params


def stage_options(cls, arg: str = "opts"):
    """Give a click command every option of `cls`; the command receives them as one `opts=cls(...)` argument (named
    `arg`: a command taking several options classes names each).

    Former names stay as hidden flags that fill the same option (an explicit flag wins over a default)."""
    hints = typing.get_type_hints(cls)
    fields = user_fields(cls)

    def decorate(fn):
        @functools.wraps(fn)
        def command(*args, **kwargs):
            return fn(*args, **{arg: cls(**{f.name: kwargs.pop(f.name) for f in fields}), **kwargs})

        for f in reversed(fields):
            for decls, attrs in reversed(_params(f, hints[f.name])):
                command = click.option(*decls, **attrs)(command)
        return command

    return decorate


def stage_command(name: str, cls, json_help: str, arg: str = "ref", group=click, hidden: bool = False):
    """A stage's command (on `group`, a click group or click itself): an optional REF argument, every option of `cls`
    and --json; the function receives (ctx, ref, opts, as_json)."""
    def wrap(fn):
        fn = click.option("--json", "as_json", is_flag=True, help=json_help)(click.pass_context(fn))
        return group.command(name, hidden=hidden)(click.argument(arg, required=False)(stage_options(cls)(fn)))
    return wrap
