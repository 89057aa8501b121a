"""Metrics of a generation task: the target's parsed answers against each example's reference answer.

Pure functions, no model. ``Parsed`` answers come from the task's output contract (``templates.contract``), so an
answer that breaks the contract scores 0 on every metric: production would receive nothing usable from it.

* ``field_exact_match``: for a JSON object reference, the share of its fields whose value the answer gives exactly
  (after ``normalize``), averaged over examples; for any other reference, whether the whole value matches.
* ``token_f1``: SQuAD-style token F1 between the answer's and the reference's words, per field, averaged the same
  way: partial credit for "Acme Bank Ltd" against "Acme Bank".
* ``contract_rate``: the share of answers that keep the contract (``instruction_following`` counts the same).
* ``supported``: entity consistency of one answer: every free value in it (a string or number whose schema gives
  no ``enum`` or ``const``) can be found in the input. A model that invents a phone number or an amount fails.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any, Mapping, Sequence

from templates.contract import Parsed

EDGE_PUNCTUATION = ".,;:!?\"'`()[]{}"
WORDS = re.compile(r"\w+")
NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?")


def normalize(value: Any) -> Any:
    """A comparable form: strings case-folded with whitespace collapsed and edge punctuation stripped, numbers as
    floats (1 == 1.0), lists as sorted tuples (order-free), objects by sorted keys."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return " ".join(value.casefold().split()).strip(EDGE_PUNCTUATION + " ")
    if isinstance(value, list):
        return tuple(sorted((normalize(v) for v in value), key=repr))
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), normalize(v)) for k, v in value.items()))
    return repr(value)


def _words(value: Any) -> list[str]:
    if isinstance(value, (list, tuple)):
        return [w for item in value for w in _words(item)]
    if isinstance(value, Mapping):
        return [w for item in value.values() for w in _words(item)]
    if value is None:
        return []
    if isinstance(value, bool):
        return [str(value).lower()]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return WORDS.findall(str(value).casefold())


def token_f1(answer: Any, reference: Any) -> float:
    a, r = _words(answer), _words(reference)
    if not a and not r:
        return 1.0
    common = sum((Counter(a) & Counter(r)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(a), common / len(r)
    return 2 * precision * recall / (precision + recall)


def _fields(reference: Any) -> list[Any]:
    return list(reference) if isinstance(reference, Mapping) and reference else [None]


def _get(value: Any, field: Any) -> Any:
    if field is None:
        return value
    return value.get(field) if isinstance(value, Mapping) else None


def example_scores(parsed: Parsed, reference: Any) -> tuple[float, float]:
    """(field exact match, token F1) of one answer; 0 for an answer that broke the contract."""
    if not parsed.ok:
        return 0.0, 0.0
    fields = _fields(reference)
    exact = [normalize(_get(parsed.value, f)) == normalize(_get(reference, f)) for f in fields]
    f1 = [token_f1(_get(parsed.value, f), _get(reference, f)) for f in fields]
    return sum(exact) / len(fields), sum(f1) / len(fields)


def generation_metrics(parsed: Sequence[Parsed], references: Sequence[Any]) -> dict[str, float]:
    if len(parsed) != len(references):
        raise ValueError(f"{len(parsed)} answers for {len(references)} references")
    if not parsed:
        return {"field_exact_match": float("nan"), "token_f1": float("nan"), "contract_rate": float("nan")}
    scores = [example_scores(p, r) for p, r in zip(parsed, references)]
    return {
        "field_exact_match": sum(s[0] for s in scores) / len(scores),
        "token_f1": sum(s[1] for s in scores) / len(scores),
        "contract_rate": sum(p.ok for p in parsed) / len(parsed),
    }


def _numbers(text: str) -> set[float]:
    out = set()
    for match in NUMBER.findall(text):
        try:
            out.add(float(match.replace(",", "")))
        except ValueError:
            continue
    return out


def free_values(value: Any, schema: Mapping | None) -> list[Any]:
    """The strings and numbers in ``value`` that its schema does not fix with an enum or a const."""
    schema = schema if isinstance(schema, Mapping) else {}
    if "enum" in schema or "const" in schema or isinstance(value, bool) or value is None:
        return []
    if isinstance(value, Mapping):
        properties = schema.get("properties", {})
        return [v for k, item in value.items() for v in free_values(item, properties.get(k))]
    if isinstance(value, list):
        return [v for item in value for v in free_values(item, schema.get("items"))]
    if isinstance(value, str) and not value.strip():
        return []
    return [value]


def supported(parsed: Parsed, input_text: str, schema: Mapping | None = None) -> bool:
    """Whether every free value of a kept answer appears in the input (strings as case-folded, whitespace-collapsed
    substrings; numbers by value, so "1,250" in the input supports 1250). A broken answer supports nothing."""
    if not parsed.ok:
        return False
    haystack = " ".join(input_text.casefold().split())
    numbers = None
    for value in free_values(parsed.value, schema):
        if isinstance(value, (int, float)):
            numbers = _numbers(input_text) if numbers is None else numbers
            if not any(math.isclose(value, n, rel_tol=0, abs_tol=1e-9) for n in numbers):
                return False
        elif " ".join(str(value).casefold().split()) not in haystack:
            return False
    return True
