"""The output contract: how an application turns the target model's raw answer into a result.

A contract ships with each template version, like its decision rule: it is the production decision for a
template whose answer is text rather than label log-probs. ``OutputContract.parse`` is what an application
runs on each answer, and the same function computes the measured instruction-following rate (the fraction
of answers that parse), so the figure a version records is the figure of what ships.

Three kinds, as the task file declares:

* ``labels``: one of the label words, either as the first word (``first_word``) or as the whole answer
  (``exact``); case and surrounding punctuation are ignored. The result is the label's name.
* ``json``: a JSON value (a single markdown code fence around it is accepted) that matches a small subset
  of JSON Schema. The result is the parsed value. With ``extract: first`` the value is the first JSON object or
  array in the answer and text around it is ignored, as many applications parse; generation then stops as soon
  as that value closes.
* ``regex``: the whole answer, stripped of surrounding whitespace, must fullmatch a pattern. With ``extract:
  first`` the value is the first match of the pattern anywhere in the answer ("The number is 09061701461." gives
  09061701461), as an application that searches the answer would read it.

Patterns (a regex contract's, a JSON schema's ``pattern``) are RE2 syntax and run on RE2 (``templates.patterns``):
an answer is text the model shaped, and a backtracking engine would let a pattern such as ``(a+)+$`` take
exponential time on it. A pattern RE2 cannot express (backreferences, lookaround) is refused when the contract is
built, so a task file that holds one is refused when it is read.

An answer that breaks its contract is data, not an error: ``parse`` never raises, it returns ``Parsed`` with
``ok=False`` and a short reason. A contract that is itself wrong raises ``ContractError`` when it is built.

Pure: no model, no I/O. Text in, a result out.

The module is long because the three kinds share one ``parse`` with one set of guarantees (never raises, linear
time, bounded depth and length); the JSON Schema subset is most of it, and splitting it would split those checks.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from templates import patterns

KINDS = ("labels", "json", "regex")
KIND_FIELDS = {"labels": ("labels", "words"), "json": ("schema", "extract"), "regex": ("pattern", "extract")}
EXTRACTS = ("whole", "first")
RULES = ("first_word", "exact")
JSON_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
EXACT_PUNCTUATION = ".!,;:\"'*`()[]"
CUT_OFF = "cut off at the token limit"
WORD = re.compile(r"\w+")
FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_SCHEMA_DEPTH = 32  # levels of a contract's JSON schema (properties, items): deeper is recursion, not a format
MAX_SCHEMA_CHARS = 65_536  # a contract's schema as JSON text: a format an answer keeps is far smaller


class ContractError(ValueError):
    """An output contract's definition is not acceptable; the message names the fix."""


@dataclass(frozen=True)
class Parsed:
    ok: bool
    value: Any  # labels: the label name; json: the parsed value; regex: the stripped answer. None when not ok
    reason: str = ""  # "" when ok, else a short lowercase reason


class _NotJSON(ValueError):
    """Raised from json.loads hooks: a number JSON cannot carry."""


def _reject_constant(name: str) -> Any:
    raise _NotJSON("NaN/Infinity are not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotJSON(f"number {text[:20]} is out of range")
    return value


def short(value: Any, limit: int = 20) -> str:
    """A value for a reason or an error line: strings quoted and cut to ``limit`` characters, others as JSON (or
    their repr) cut to twice that: an answer, or a setting read from a file, never comes back whole."""
    if isinstance(value, str):
        return repr(value if len(value) <= limit else value[:limit] + "...")
    try:
        text = json.dumps(value, ensure_ascii=False, default=repr)
    except (ValueError, RecursionError):  # a circular or too deep value
        text = type(value).__name__
    return text if len(text) <= 2 * limit else text[:2 * limit] + "..."


def unknown_names(names: list, what: str = "unknown key") -> str:
    """Unknown keys or fields as an error names them: how many, and the first one's name cut to 40 characters
    (escaped where it is not a plain dotted name), never the rest: a file of another kind must not come back."""
    first = str(names[0])
    first = first if re.fullmatch(r"[\w.-]{1,40}", first) else short(first, 37)
    return f"{len(names)} {what}(s) (the first: {first})"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def _is_type(value: Any, name: str) -> bool:
    actual = _json_type(value)
    if name == "number":
        return actual in ("number", "integer")
    if name == "integer":
        return actual == "integer" or (actual == "number" and value.is_integer())
    return actual == name


def _canon(value: Any) -> Any:
    """A hashable key under which two JSON values are equal exactly when JSON Schema says so (true != 1 == 1.0)."""
    if isinstance(value, bool) or value is None:
        return ("literal", value)
    if isinstance(value, (int, float)):
        return ("number", value)
    if isinstance(value, list):
        return ("array", tuple(_canon(v) for v in value))
    if isinstance(value, dict):
        return ("object", tuple(sorted((k, _canon(v)) for k, v in value.items())))
    return ("string", value)


def _bracket_depths(text: str, start: int = 0):
    """(index, depth after it) for each bracket outside JSON strings, from ``start``: a linear scan, so that no
    input ever reaches json.loads' recursion before its depth is known."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{]}":
            depth += 1 if ch in "[{" else -1
            yield i, depth


def _too_deep(text: str, limit: int) -> bool:
    """Whether brackets outside strings nest deeper than ``limit``."""
    return any(depth > limit for _, depth in _bracket_depths(text))


def _opening(text: str) -> int | None:
    """Where the first JSON object or array starts, or None."""
    found = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    return min(found) if found else None


def _closing(text: str, start: int) -> int | None:
    """The end (exclusive) of the bracketed value opening at ``start``, or None if it does not close."""
    return next((i + 1 for i, depth in _bracket_depths(text, start) if depth == 0), None)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


SCHEMA_KEYWORDS = {  # the JSON Schema subset: keyword -> (check of its value, what the value must be)
    "type": (lambda v: v in JSON_TYPES or (isinstance(v, list) and v and all(t in JSON_TYPES for t in v)),
             f"one of {'/'.join(JSON_TYPES)} or a list of them"),
    "enum": (lambda v: isinstance(v, list), "a list of the allowed values"),
    "const": (lambda v: True, "any JSON value"),
    "pattern": (lambda v: isinstance(v, str), "a regular expression in RE2 syntax"),  # RE2 compiles it: _check_schema
    "minLength": (_count, "a non-negative integer"),
    "maxLength": (_count, "a non-negative integer"),
    "minimum": (_number, "a finite number"),
    "maximum": (_number, "a finite number"),
    "properties": (lambda v: isinstance(v, Mapping) and all(isinstance(k, str) for k in v),
                   "a mapping from field names to schemas"),
    "required": (lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v), "a list of field names"),
    "additionalProperties": (lambda v: isinstance(v, bool), "true or false (a schema there is not supported)"),
    "items": (lambda v: isinstance(v, Mapping), "a schema"),
    "minItems": (_count, "a non-negative integer"),
    "maxItems": (_count, "a non-negative integer"),
    "uniqueItems": (lambda v: isinstance(v, bool), "true or false"),
    "description": (lambda v: True, "any text"),
    "title": (lambda v: True, "any text"),
}


def _check_schema(schema: Any, where: str, depth: int = 0) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise ContractError(f"json schema is nested deeper than {MAX_SCHEMA_DEPTH} levels (at {where[:60]}...); "
                            "flatten it")
    if not isinstance(schema, Mapping):
        raise ContractError(f"json schema at {where[:60]} must be a mapping such as {{'type': 'object'}}, "
                            f"not {short(schema)}")
    unknown = sorted(str(k) for k in set(schema) - set(SCHEMA_KEYWORDS))
    if unknown:
        raise ContractError(f"json schema at {where[:60]} has {unknown_names(unknown, 'unsupported keyword')}; "
                            f"supported: {', '.join(SCHEMA_KEYWORDS)}")
    for keyword, value in schema.items():
        valid, what = SCHEMA_KEYWORDS[keyword]
        if not valid(value):
            raise ContractError(f"json schema at {where[:60]}: {keyword} must be {what}, not {short(value)}")
    refused = patterns.refusal(schema["pattern"]) if "pattern" in schema else None
    if refused:
        raise ContractError(f"json schema at {where[:60]}: pattern {short(schema['pattern'], 40)}: {refused}")
    for name, sub in schema.get("properties", {}).items():
        _check_schema(sub, f"{where}.properties.{name}", depth + 1)
    if "items" in schema:
        _check_schema(schema["items"], f"{where}.items", depth + 1)


def _violation(value: Any, schema: Mapping, path: str) -> str | None:
    """The first way ``value`` breaks ``schema``, or None. Recursion follows the value, whose depth is bounded."""
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_is_type(value, t) for t in types):
            return f"{path}: expected {'/'.join(types)}, got {_json_type(value)}"
    if "const" in schema and _canon(value) != _canon(schema["const"]):
        return f"{path}: {short(value)} is not the constant {short(schema['const'])}"
    if "enum" in schema and _canon(value) not in {_canon(v) for v in schema["enum"]}:
        return f"{path}: {short(value)} is not one of {short(schema['enum'])}"
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            return f"{path}: {short(value)} is shorter than minLength {schema['minLength']}"
        if len(value) > schema.get("maxLength", math.inf):
            return f"{path}: {short(value)} is longer than maxLength {schema['maxLength']}"
        if "pattern" in schema and patterns.search(schema["pattern"], value) is None:
            return f"{path}: {short(value)} does not match pattern {short(schema['pattern'], 40)}"
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if value < schema.get("minimum", -math.inf):
            return f"{path}: {short(value)} is below minimum {schema['minimum']}"
        if value > schema.get("maximum", math.inf):
            return f"{path}: {short(value)} is above maximum {schema['maximum']}"
    elif isinstance(value, dict):
        properties = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                return f"{path}: missing required field {name!r}"
        for name, item in value.items():
            field_path = f"{path}.{name}" if FIELD_NAME.fullmatch(name) else f"{path}[{json.dumps(name)}]"
            if name in properties:
                found = _violation(item, properties[name], field_path)
                if found:
                    return found
            elif schema.get("additionalProperties", True) is False:
                return f"{path}: unexpected field {short(name)}"
    elif isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            return f"{path}: {len(value)} items, fewer than minItems {schema['minItems']}"
        if len(value) > schema.get("maxItems", math.inf):
            return f"{path}: {len(value)} items, more than maxItems {schema['maxItems']}"
        if schema.get("uniqueItems"):
            seen: dict[Any, int] = {}
            for i, item in enumerate(value):
                j = seen.setdefault(_canon(item), i)
                if j != i:
                    return f"{path}[{i}]: duplicate of {path}[{j}]"
        for i, item in enumerate(value):
            found = _violation(item, schema.get("items", {}), f"{path}[{i}]")
            if found:
                return found
    return None


@dataclass(frozen=True)
class OutputContract:
    kind: str  # "labels" | "json" | "regex"
    labels: tuple[str, ...] = ()  # labels: label names, in order
    words: tuple[str, ...] = ()  # labels: the answer word of each label, e.g. ("yes", "no")
    rule: str = "first_word"  # labels: "first_word" or "exact"
    schema: Mapping | None = None  # json: a JSON-Schema subset (SCHEMA_KEYWORDS)
    pattern: str | None = None  # regex: the whole stripped answer must fullmatch it (RE2 syntax)
    max_chars: int = 4000  # longer answers fail
    max_depth: int = 16  # json: deeper nesting fails
    extract: str = "whole"  # json/regex: the "whole" answer, or the "first" object/array or match in it

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ContractError(f"contract kind {short(self.kind)} is not one of {list(KINDS)}")
        for name in ("labels", "words"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
                raise ContractError(f"contract {name} must be a list of strings, not {short(value)}")
            object.__setattr__(self, name, tuple(value))
        for name in ("max_chars", "max_depth"):
            limit = getattr(self, name)
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise ContractError(f"contract {name}={str(limit)[:20]} must be a positive integer")
        if self.extract not in EXTRACTS:
            raise ContractError(f"contract extract {short(self.extract)} is not one of {list(EXTRACTS)}")
        if self.rule not in RULES:
            raise ContractError(f"contract rule {short(self.rule)} is not one of {list(RULES)}")
        given = {"labels": self.labels, "words": self.words, "schema": self.schema is not None,
                 "pattern": self.pattern is not None, "extract": self.extract != "whole"}
        stray = [name for name, value in given.items() if value and name not in KIND_FIELDS[self.kind]]
        if stray:
            raise ContractError(f"a {self.kind} contract takes no {', '.join(stray)}; remove them or change its kind")
        if self.kind == "labels":
            self._check_labels()
        elif self.kind == "json":
            _check_schema(self.schema, "$")
            try:  # a private JSON copy: to_dict must be JSON-able, and the caller's dict may change later
                copy = json.dumps(self.schema, allow_nan=False, default=dict)
                object.__setattr__(self, "schema", json.loads(copy))
            except (TypeError, ValueError, RecursionError) as exc:
                raise ContractError(f"contract schema must be plain JSON: {str(exc)[:80]}") from None
            if len(copy) > MAX_SCHEMA_CHARS:
                raise ContractError(f"contract schema is {len(copy):,} characters of JSON, over the limit of "
                                    f"{MAX_SCHEMA_CHARS:,}; give a smaller schema")
        elif not isinstance(self.pattern, str):
            raise ContractError(f"a regex contract needs a pattern that compiles, not {short(self.pattern, 40)}")
        else:
            refused = patterns.refusal(self.pattern)  # compiled once here; parse reuses it (patterns caches it)
            if refused:
                raise ContractError(f"pattern {short(self.pattern, 40)}: {refused}")

    def _check_labels(self) -> None:
        if len(self.labels) < 2 or len(self.words) != len(self.labels):
            raise ContractError(f"a labels contract needs two or more labels, each with its answer word; got "
                                f"labels {list(self.labels)} and words {list(self.words)}")
        if not all(isinstance(label, str) and label for label in self.labels) or (
                len(set(self.labels)) != len(self.labels)):
            raise ContractError(f"contract labels {list(self.labels)} must be distinct non-empty strings")
        for word in self.words:
            if not isinstance(word, str) or not WORD.fullmatch(word):
                raise ContractError(f"contract word {short(word)} must be one word of letters and digits, e.g. 'yes'")
        if len({word.casefold() for word in self.words}) != len(self.words):
            raise ContractError(f"contract words {list(self.words)} must differ ignoring case")

    def parse(self, answer: str | bytes | None, *, truncated: bool = False) -> Parsed:
        """The result of one answer, or why it breaks the contract. Never raises."""
        if isinstance(answer, (bytes, bytearray, memoryview)):
            try:
                answer = bytes(answer).decode("utf-8")
            except UnicodeDecodeError:
                return Parsed(False, None, "invalid UTF-8")
        if answer is None or (isinstance(answer, str) and not answer.strip()):
            return Parsed(False, None, "empty answer")
        if not isinstance(answer, str):
            return Parsed(False, None, f"answer is not text but {type(answer).__name__}")
        try:
            answer.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates, e.g. from surrogateescape decoding
            return Parsed(False, None, "invalid UTF-8")
        if len(answer) > self.max_chars:
            return Parsed(False, None, f"answer longer than {self.max_chars} characters")
        if self.kind == "labels":
            return self._parse_labels(answer, truncated)
        if self.kind == "regex" and self.extract == "first":
            return self._parse_first_match(answer, truncated)
        if self.extract == "first":  # a closed value is whole even if the answer ran on to the limit
            found = self._parse_first_json(answer)
            return Parsed(False, None, CUT_OFF) if truncated and not found.ok and _opening(answer) else found
        if truncated:
            return Parsed(False, None, CUT_OFF)
        text = answer.strip()
        if self.kind == "regex":
            if patterns.fullmatch(self.pattern, text):
                return Parsed(True, text)
            return Parsed(False, None, f"answer {short(text)} does not match pattern {short(self.pattern, 40)}")
        return self._parse_json(text)

    def _parse_labels(self, answer: str, truncated: bool) -> Parsed:
        by_word = {word.casefold(): label for word, label in zip(self.words, self.labels)}
        choices = "/".join(self.words)
        if self.rule == "exact":
            if truncated:
                return Parsed(False, None, CUT_OFF)
            text = answer.strip().strip(EXACT_PUNCTUATION + " \t\r\n\f\v")
            if text.casefold() in by_word:
                return Parsed(True, by_word[text.casefold()])
            return Parsed(False, None, f"answer {short(text)} is not one of the label words {choices}")
        first = WORD.search(answer)
        if first is None:
            return Parsed(False, None, "no words in the answer")
        if truncated and first.end() == len(answer):  # the word may have been cut mid-way
            return Parsed(False, None, CUT_OFF)
        word = first.group()
        if word.casefold() in by_word:
            return Parsed(True, by_word[word.casefold()])
        return Parsed(False, None, f"first word {short(word)} is not one of the label words {choices}")

    def _parse_json(self, text: str) -> Parsed:
        if len(text) >= 6 and text.startswith("```") and text.endswith("```"):
            text = text[3:-3]
            text = (text[4:] if text[:4].lower() == "json" else text).strip()
        if _too_deep(text, self.max_depth):
            return Parsed(False, None, f"JSON nested deeper than {self.max_depth} levels")
        try:
            value = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
        except _NotJSON as exc:
            return Parsed(False, None, f"not JSON: {exc}")
        except (ValueError, RecursionError):
            return Parsed(False, None, "not JSON")
        found = _violation(value, self.schema, "$")
        return Parsed(False, None, found) if found else Parsed(True, value)

    def _parse_first_json(self, answer: str) -> Parsed:
        start = _opening(answer)
        if start is None:
            return Parsed(False, None, "no JSON object or array in the answer")
        end = _closing(answer, start)
        if end is None:
            return Parsed(False, None, "the JSON value is not closed")
        return self._parse_json(answer[start:end])

    def _parse_first_match(self, answer: str, truncated: bool) -> Parsed:
        span = patterns.search(self.pattern, answer)
        matched = answer[span[0]:span[1]].strip() if span is not None else ""
        if span is not None and not (truncated and span[1] == len(answer)) and matched:
            return Parsed(True, matched)
        if truncated:  # no match yet, or one that may go on past the limit ("0906170" of "09061701461")
            return Parsed(False, None, CUT_OFF)
        return Parsed(False, None, f"no match of the pattern {short(self.pattern, 40)} in the answer")

    def complete(self, answer: str) -> bool:
        """Whether more tokens cannot change ``parse``'s result, so a generator may stop: a first word followed
        by a non-word character (labels, first_word), or a closed first JSON value (json, extract first); other
        kinds run to the end of the answer."""
        if self.kind == "json" and self.extract == "first" and isinstance(answer, str):
            start = _opening(answer)
            return start is not None and _closing(answer, start) is not None
        if self.kind != "labels" or self.rule != "first_word" or not isinstance(answer, str):
            return False
        first = WORD.search(answer)
        return first is not None and first.end() < len(answer)

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind == "labels":
            out.update(labels=list(self.labels), words=list(self.words), rule=self.rule)
        elif self.kind == "json":
            out.update(schema=json.loads(json.dumps(self.schema)), max_depth=self.max_depth)  # a copy to keep
            if self.extract != "whole":  # absent for whole answers: earlier records keep their content hash
                out["extract"] = self.extract
        else:
            out.update(pattern=self.pattern)
            if self.extract != "whole":
                out["extract"] = self.extract
        out["max_chars"] = self.max_chars
        return out

    @classmethod
    def from_dict(cls, data: Any) -> "OutputContract":
        if not isinstance(data, Mapping) or "kind" not in data:
            raise ContractError("an output contract record must be a mapping with a kind, e.g. {'kind': 'labels', ...}")
        fields = ("kind", "labels", "words", "rule", "schema", "pattern", "max_chars", "max_depth", "extract")
        unknown = [k for k in data if k not in fields]
        if unknown:
            raise ContractError(f"output contract record has "
                                f"{unknown_names(unknown, 'unknown field')}; known: {', '.join(fields)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ContractError(f"output contract record is malformed: {exc}") from None

    def describe(self) -> str:
        if self.kind == "labels":
            where = "first word" if self.rule == "first_word" else "the whole answer"
            return f"{where} is one of {'/'.join(self.words)} (case and surrounding punctuation ignored)"
        if self.kind == "regex":
            if self.extract == "first":
                return f"the first match of the pattern {self.pattern!r} in the answer"
            return f"the whole answer (surrounding whitespace ignored) matches the pattern {self.pattern!r}"
        required = self.schema.get("required")
        types = self.schema.get("type", "any")
        where = "the first JSON value in the answer" if self.extract == "first" else "JSON (a ``` fence allowed)"
        return (f"{where} of type {'/'.join(types) if isinstance(types, list) else types} "
                "matching its schema"
                + (f", with fields {', '.join(required)} required" if required else "")
                + f", at most {self.max_depth} levels deep")
