"""The `json` task: extract facts from a sentence as a JSON object that follows a given JSON Schema.

The items (data/json_tasks.jsonl, written for llmq) climb in difficulty: two flat fields, numbers and booleans,
enums, string patterns (dates, e-mail), arrays, nested objects, arrays of objects, nullable fields. Generation is
unconstrained, so what quantization does to a model's JSON shows. An answer's JSON is its first JSON object (prose
or a code fence around it is allowed); `valid`: it exists and validates against the schema (jsonschema, the
schema's own draft); `fields`: the share of the expected values it holds (strings compared without case and
surrounding whitespace, numbers by value, each array of plain values as a multiset, arrays of objects item by item).
"""

from __future__ import annotations

import json
import re

PROMPT = ("Extract the information in the text below as one JSON object that follows this JSON Schema. "
          "Answer with the JSON object only.\n\nJSON Schema:\n{schema}\n\nText: {text}")
MAX_TOKENS = 256


# one worked example before each item (a schema and sentence of a kind the items do not use): a small model otherwise
# answers with the schema itself
EXAMPLE = ({"type": "object", "properties": {"animal": {"type": "string"}, "legs": {"type": "integer"}},
            "required": ["animal", "legs"], "additionalProperties": False},
           "A spider has eight legs.", {"animal": "spider", "legs": 8})


def messages(row: dict) -> list[dict]:
    schema, text, answer = EXAMPLE
    return [{"role": "user", "content": PROMPT.format(schema=json.dumps(schema), text=text)},
            {"role": "assistant", "content": json.dumps(answer)},
            {"role": "user", "content": PROMPT.format(schema=json.dumps(row["schema"]), text=row["text"])}]


def first_object(text: str):
    """The first JSON object in `text`, or None."""
    dec = json.JSONDecoder()
    for m in re.finditer(r"\{", text):
        try:
            value, _ = dec.raw_decode(text, m.start())
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _same(expected, got) -> bool:
    if isinstance(expected, bool) or expected is None:
        return got is expected
    if isinstance(expected, (int, float)):
        return isinstance(got, (int, float)) and not isinstance(got, bool) and got == expected
    if isinstance(expected, str):
        return isinstance(got, str) and " ".join(got.split()).casefold() == " ".join(expected.split()).casefold()
    return False


def _fields(expected, got) -> tuple[int, int]:
    """(expected values found, expected values) under `expected`."""
    if isinstance(expected, dict):
        pairs = [_fields(v, got.get(k) if isinstance(got, dict) else None) for k, v in expected.items()]
        return sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    if isinstance(expected, list) and expected and isinstance(expected[0], dict):
        items = got if isinstance(got, list) else []
        pairs = [_fields(e, items[i] if i < len(items) else None) for i, e in enumerate(expected)]
        return sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    if isinstance(expected, list):
        rest = list(got) if isinstance(got, list) else []
        found = 0
        for e in expected:
            hit = next((i for i, g in enumerate(rest) if _same(e, g)), None)
            if hit is not None:
                rest.pop(hit)
                found += 1
        return int(found == len(expected) and not rest), 1
    return int(_same(expected, got)), 1


def score(row: dict, text: str) -> dict[str, float]:
    """{"valid": 0 or 1, "fields": share of the expected values found}."""
    import jsonschema

    obj = first_object(text)
    if obj is None:
        return {"valid": 0.0, "fields": 0.0}
    validator = jsonschema.validators.validator_for(row["schema"])
    valid = validator(row["schema"], format_checker=validator.FORMAT_CHECKER).is_valid(obj)
    found, total = _fields(row["expected"], obj)
    return {"valid": float(valid), "fields": found / total}
