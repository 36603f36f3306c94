"""BFCL's AST-match rules, written for llmq: is a model's set of function calls one of the possible answers?

A question's possible answers are, per expected call, {function: {parameter: [allowed values]}}; "" among a
parameter's allowed values makes it optional. The rules (as BFCL's checker applies them; benchmarks/bfcl_agreement.py
compares the two on the same outputs):
- the number of calls must equal the number expected; a simple question takes exactly one call, a `multiple` one
  the one expected call (its function picked from several), a `parallel` one its calls in any order: each expected
  call, in turn, takes the first call not yet taken that matches it;
- a call matches when it names the expected function, gives every required parameter, gives only parameters that
  are both documented and in the answer, gives each a value of the documented type (an integer passes for a float;
  an array's items are checked one level down) and an allowed value, and leaves out only optional ones;
- strings compare case-insensitively without spaces and the characters ,./-_*^ (single quotes as double); lists
  compare item by item in order, their strings so normalized; objects key by key, each value among the allowed ones
  (normalized where a string), a missing key only where it is optional; a list of objects item by item in order;
- a value whose type is not the documented one but is the allowed values' own type (BFCL writes a variable's name
  as a string where an integer is documented) is compared as it is;
- an irrelevance question passes when no call is made (text, or calls that do not parse), a relevance one when one is.
"""

from __future__ import annotations

import re

PY_TYPES = {"string": str, "integer": int, "float": float, "boolean": bool, "array": list, "tuple": list,
            "dict": dict, "any": str}
NESTED = ("array", "tuple")
_STRIP = re.compile(r"[ ,./\-_*^]")

Calls = list[tuple[str, dict]]  # (function name, arguments), in the order the model wrote them


def normalize(s: str) -> str:
    return _STRIP.sub("", s).lower().replace("'", '"')


def _norm(v):
    return normalize(v) if isinstance(v, str) else v


def _answer_type(allowed: list):
    """The type of the first allowed value that is not the optional marker "", or None."""
    return next((type(a) for a in allowed if a != ""), None)


def _type_ok(value, allowed: list, expected: type, inner: type | None) -> tuple[bool, bool]:
    """(the value's type passes, it is a 'variable': compared as it is, not by type-specific rules)."""
    answer_type = _answer_type(allowed)
    variable = answer_type is not None and answer_type is not expected
    if type(value) is expected:
        if inner is None:
            return True, variable
        for alt in allowed:  # some allowed value (a list, or "") under which every item has the inner type
            if not isinstance(alt, list) or all(_type_ok(item, alt, inner, None)[0] for item in value):
                return True, variable
        return False, variable
    return answer_type is not None and type(value) is answer_type, True


def _dict_ok(value: dict, alternatives: list) -> bool:
    for alt in alternatives:
        if alt == "":
            continue
        if all(k in alt and _norm(v) in [_norm(a) for a in alt[k]] for k, v in value.items()) and \
                all(k in value or "" in allowed for k, allowed in alt.items()):
            return True
    return False


def _seq(alt) -> list:
    """An allowed value as a list of items (the optional marker "" is the empty list)."""
    return list(alt) if isinstance(alt, (list, str)) else [alt]


def _list_of_dicts_ok(value: list, alternatives: list) -> bool:
    return any(len(_seq(alt)) == len(value) and all(_dict_ok(v, [a]) for v, a in zip(value, _seq(alt)))
               for alt in alternatives)


def _value_ok(value, allowed: list, expected: type, inner: type | None, variable: bool) -> bool:
    if not variable:
        if expected is dict:
            return _dict_ok(value, allowed)
        if expected is list and inner is dict:
            return _list_of_dicts_ok(value, allowed)
        if expected is str:
            return normalize(value) in [normalize(a) for a in allowed if isinstance(a, str)]
        if expected is list:
            return [_norm(v) for v in value] in [[_norm(a) for a in _seq(alt)] for alt in allowed]
    return value in allowed


def call_matches(function: dict, call: tuple[str, dict], answer: dict) -> bool:
    """Does `call` match the one expected call `answer` ({name: {parameter: allowed}}) of `function`, BFCL's
    document of the expected function?"""
    (expected_name, params), = answer.items()
    name, args = call
    if name != function["name"]:
        return False
    doc = function["parameters"]
    props = doc.get("properties", {})
    if any(p not in args for p in doc.get("required", [])):
        return False
    for p, value in args.items():
        if p not in props or p not in params:
            return False
        kind = props[p]["type"]
        expected = PY_TYPES[kind]
        inner = PY_TYPES[props[p]["items"]["type"]] if kind in NESTED else None
        if isinstance(value, tuple):
            value = list(value)
        if kind == "float" and type(value) is int:
            value = float(value)
        ok, variable = _type_ok(value, params[p], expected, inner)
        if not ok or not _value_ok(value, params[p], expected, inner, variable):
            return False
    return all(p in args or "" in allowed for p, allowed in params.items())


def _describe(functions: list[dict], name: str) -> dict | None:
    return next((f for f in functions if f["name"] == name), None)


def ast_match(category: str, functions: list[dict], calls: Calls | None, answer: list[dict] | None) -> bool:
    """One question's verdict. calls: what the model called (None: its calls did not parse, or it made none).
    answer: the possible answers (None for the relevance categories)."""
    if answer is None:
        made = bool(calls)
        return not made if "irrelevance" in category else made
    if not calls or len(calls) != (len(answer) if "parallel" in category or "multiple" in category else 1):
        return False
    if "parallel" in category:
        taken: set[int] = set()
        for expected in answer:
            fn = _describe(functions, next(iter(expected)))
            hit = next((i for i, c in enumerate(calls) if i not in taken and fn is not None
                        and call_matches(fn, c, expected)), None)
            if hit is None:
                return False
            taken.add(hit)
        return True
    fn = functions[0] if "multiple" not in category else _describe(functions, next(iter(answer[0])))
    return fn is not None and call_matches(fn, calls[0], answer[0])
