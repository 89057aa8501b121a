"""Strict prompt templates: declared variables, declared constraints, nothing evaluated.

A template is a piece of text with ``{name}`` placeholders. The text may come from a
policy model, so it is untrusted: parsing accepts only bare identifiers inside braces,
``{{`` and ``}}`` stand for literal braces, and anything else with a brace in it
(``{text.__class__}``, ``{0}``, ``{text:{width}}``, ``{% ... %}``) is rejected when the
template is built. Rendering is a single pass that joins literal segments with the
caller's values; a value is inserted as-is and never scanned for placeholders again,
so neither the template nor a value can make the renderer evaluate anything.

A ``regex`` constraint runs on RE2 (linear time in the value's length, whatever the pattern), so a pattern
such as ``(a+)+$`` cannot stall rendering. RE2 has no backreferences or lookaround, and its ``\\d``, ``\\w``
and ``\\b`` are ASCII-only (``templates.patterns``, shared with the output contracts, lists the differences from
``re``); a pattern using an unsupported feature is refused when the constraint is built.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from templates.contract import short, unknown_names
from templates.decision import DecisionError, DecisionRule
from templates.patterns import fullmatch as _fullmatch
from templates.patterns import refusal as _refusal

MAX_INPUT_CHARS = 100_000  # characters of one input: about 25,000 tokens, past any target's context

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# One scan over the text: escaped braces, a placeholder, or a lone brace (an error).
_TOKEN = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}|\{|\}")

MAX_TEMPLATE_CHARS = 20_000
"""Hard cap on template text. Token budgets are checked separately by ``validate_candidate``."""


class TemplateError(ValueError):
    """A template or a rendering request is not acceptable; the message names the fix."""


CONSTRAINT_OPS = ("in", "regex", "max_chars")


@dataclass(frozen=True)
class Constraint:
    """A check on one variable's value at render time.

    ``in``: the value must be one of ``arg`` (a tuple of strings);
    ``regex``: the value must fully match ``arg``;
    ``max_chars``: the value may be at most ``arg`` characters long.
    """

    variable: str
    op: str
    arg: Any

    def __post_init__(self) -> None:
        if self.op not in CONSTRAINT_OPS:
            raise TemplateError(
                f"constraint on {self.variable!r}: unknown operator {self.op!r}; use one of {', '.join(CONSTRAINT_OPS)}"
            )
        if self.op == "in":
            if isinstance(self.arg, str) or not isinstance(self.arg, Iterable):
                raise TemplateError(f"constraint on {self.variable!r}: 'in' needs a list of allowed values")
            object.__setattr__(self, "arg", tuple(str(v) for v in self.arg))
        elif self.op == "regex":
            object.__setattr__(self, "arg", str(self.arg))
            refused = _refusal(self.arg)  # compiled once here; templates.patterns caches it for violation
            if refused:
                raise TemplateError(f"constraint on {self.variable!r}: bad regular expression {self.arg[:80]!r}: "
                                    f"{refused}")
        elif self.op == "max_chars":
            if not isinstance(self.arg, int) or isinstance(self.arg, bool) or not 0 <= self.arg <= MAX_INPUT_CHARS:
                raise TemplateError(f"constraint on {short(self.variable, 40)}: 'max_chars' needs a whole number "
                                    f"from 0 to {MAX_INPUT_CHARS:,}")

    def violation(self, value: str) -> str | None:
        """The reason ``value`` breaks this constraint, or None when it holds."""
        if self.op == "in" and value not in self.arg:
            return f"{self.variable}={value[:40]!r} is not one of {list(self.arg)}"
        # RE2 matches UTF-8, which has no lone surrogates (JSON data may carry them): those match as U+FFFD.
        if self.op == "regex" and not _fullmatch(self.arg, value):
            return f"{self.variable}={value[:40]!r} does not match /{self.arg}/"
        if self.op == "max_chars" and len(value) > self.arg:
            return f"{self.variable} has {len(value)} characters, more than {self.arg}"
        return None

    def to_dict(self) -> dict:
        return {"variable": self.variable, "op": self.op, "arg": list(self.arg) if self.op == "in" else self.arg}


def _escape(literal: str) -> str:
    """Literal text as template text: braces doubled."""
    return literal.replace("{", "{{").replace("}", "}}")


def parse(text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Split ``text`` into literal segments and placeholder names.

    Returns ``(literals, names)`` with ``len(literals) == len(names) + 1``.
    Raises TemplateError for a stray brace or anything in braces that is not a bare identifier.
    """
    if not isinstance(text, str):
        raise TemplateError(f"template text must be a string, not {type(text).__name__}")
    if len(text) > MAX_TEMPLATE_CHARS:
        raise TemplateError(f"template has {len(text):,} characters; the limit is {MAX_TEMPLATE_CHARS:,}")
    literals: list[str] = []
    names: list[str] = []
    current: list[str] = []
    pos = 0
    for match in _TOKEN.finditer(text):
        current.append(text[pos : match.start()])
        token = match.group(0)
        if token == "{{":
            current.append("{")
        elif token == "}}":
            current.append("}")
        elif match.group(1) is not None:
            literals.append("".join(current))
            current = []
            names.append(match.group(1))
        else:
            snippet = text[max(0, match.start() - 10) : match.start() + 20]
            raise TemplateError(
                f"unsupported brace at character {match.start()} (near {snippet!r}): placeholders are "
                "{name} with a plain identifier; write {{ or }} for a literal brace"
            )
        pos = match.end()
    current.append(text[pos:])
    literals.append("".join(current))
    return tuple(literals), tuple(names)


@dataclass(frozen=True)
class Template:
    """An immutable template: text, the variables it declares, constraints on their values, and the decision
    rule that turns the target's output into a result (``templates.decision``; None for a bare template).

    Every declared variable appears exactly once in the text and no other placeholder does.
    """

    text: str
    variables: tuple[str, ...]
    constraints: tuple[Constraint, ...] = ()
    decision: DecisionRule | None = None
    _literals: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _names: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _checks: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        variables = tuple(self.variables)
        object.__setattr__(self, "variables", variables)
        object.__setattr__(self, "constraints", tuple(self.constraints))
        for name in variables:
            if not isinstance(name, str) or not IDENTIFIER.fullmatch(name):
                raise TemplateError(f"variable name {name!r} is not a plain identifier")
        if len(set(variables)) != len(variables):
            raise TemplateError(f"variables {list(variables)} name one variable twice")
        literals, names = parse(self.text)
        unknown = sorted(set(names) - set(variables))
        if unknown:
            raise TemplateError(f"template uses {unknown_names(unknown, 'undeclared placeholder')}; declared "
                                f"variables are {list(variables)}")
        missing = [v for v in variables if v not in names]
        if missing:
            raise TemplateError(f"template text lacks placeholder(s) {['{' + v + '}' for v in missing]}")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise TemplateError(f"placeholder(s) {['{' + v + '}' for v in repeated]} appear more than once")
        checks: dict[str, list[Constraint]] = {}
        for constraint in self.constraints:
            if constraint.variable not in variables:
                raise TemplateError(
                    f"constraint names {constraint.variable!r}, which is not a declared variable {list(variables)}"
                )
            checks.setdefault(constraint.variable, []).append(constraint)
        object.__setattr__(self, "_literals", literals)
        object.__setattr__(self, "_names", names)
        object.__setattr__(self, "_checks", checks)

    @classmethod
    def from_text(cls, text: str, constraints: Iterable[Constraint] = ()) -> "Template":
        """Build a template whose variables are the placeholders found in ``text`` (in order)."""
        _, names = parse(text)
        return cls(text, tuple(dict.fromkeys(names)), tuple(constraints))

    def render(self, values: Mapping[str, Any] | None = None, /, **kwargs: Any) -> str:
        """Fill every placeholder. Missing or unknown variables and broken constraints raise TemplateError."""
        if values is None:
            values = kwargs
        elif kwargs:
            values = {**values, **kwargs}
        if len(values) != len(self._names) or any(name not in values for name in self._names):
            missing = [n for n in self._names if n not in values]
            unknown = sorted(set(values) - set(self._names))
            problems = []
            if missing:
                problems.append(f"missing variable(s) {missing}")
            if unknown:
                problems.append(f"unknown variable(s) {unknown}")
            raise TemplateError(f"cannot render: {'; '.join(problems)}; the template declares {list(self.variables)}")
        literals = self._literals
        parts = [literals[0]]
        for i, name in enumerate(self._names):
            value = values[name]
            if not isinstance(value, str):
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    value = str(value)
                else:
                    raise TemplateError(f"variable {name!r} must be a string or number, not {type(value).__name__}")
            for constraint in self._checks.get(name, ()):
                reason = constraint.violation(value)
                if reason is not None:
                    raise TemplateError(f"constraint failed: {reason}")
            parts.append(value)
            parts.append(literals[i + 1])
        return "".join(parts)

    def split_at(self, variable: str) -> tuple[str, str]:
        """The literal text before and after ``variable`` when it is the only placeholder left.

        Scorers use this to compute the shared prefix of a prompt once for many examples.
        """
        if self._names != (variable,):
            raise TemplateError(f"split_at({variable!r}) needs a template whose only placeholder is {{{variable}}}")
        return self._literals[0], self._literals[1]

    @property
    def placeholders(self) -> tuple[str, ...]:
        """The placeholder names in the order the text uses them."""
        return self._names

    def input_frame(self) -> tuple["Template", "Template"]:
        """``(frame, span)`` of a template with several input placeholders: ``frame`` has one placeholder,
        ``{input_span}``, where the stretch from the first placeholder to the last one was, and ``span`` is that
        stretch with its placeholders and constraints, so ``frame.render(input_span=span.render(values))`` equals
        ``self.render(values)``. Scorers share the prompt before the input across examples and see one input per
        example. A template with one placeholder is its own frame, and its span is the bare placeholder."""
        return self._frame

    @functools.cached_property
    def _frame(self) -> tuple["Template", "Template"]:  # once per template: the serving path asks on every call
        names, literals = self._names, self._literals
        if len(names) == 1:
            return self, Template("{" + names[0] + "}", names, self.constraints)
        middle = "".join("{" + name + "}" + _escape(literal) for name, literal in zip(names, literals[1:-1]))
        span = Template(middle + "{" + names[-1] + "}", self.variables, self.constraints)
        frame = Template(_escape(literals[0]) + "{input_span}" + _escape(literals[-1]), ("input_span",),
                         decision=self.decision)
        return frame, span

    def to_dict(self) -> dict:
        record = {
            "text": self.text,
            "variables": list(self.variables),
            "constraints": [c.to_dict() for c in self.constraints],
        }
        if self.decision is not None:  # absent rather than null: a bare template's record (and hash) is unchanged
            record["decision"] = self.decision.to_dict()
        return record

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Template":
        fields = ("text", "variables", "constraints", "decision")
        unknown = [k for k in data if k not in fields]
        if unknown:
            raise TemplateError(f"template record has "
                                f"{unknown_names(unknown, 'unknown field')}; known: {', '.join(fields)}")
        if "text" not in data:
            raise TemplateError("template record needs a 'text' field")
        constraints = tuple(constraints_from_spec(data.get("constraints") or []))
        try:
            decision = None if data.get("decision") is None else DecisionRule.from_dict(data["decision"])
        except DecisionError as exc:
            raise TemplateError(f"template record: {exc}") from None
        variables = data.get("variables")
        if variables is None:
            variables = tuple(dict.fromkeys(parse(data["text"])[1]))
        elif not isinstance(variables, (list, tuple)):
            raise TemplateError(f"template record: 'variables' must be a list of names such as [text], "
                                f"not {type(variables).__name__}")
        return cls(data["text"], tuple(variables), constraints, decision)


def constraints_from_spec(spec: Any) -> list[Constraint]:
    """Constraints from either a list of ``{variable, op, arg}`` records or the short task-file form
    ``{variable: {in: [...], regex: "...", max_chars: N}}``."""
    if isinstance(spec, Mapping):
        out = []
        for variable, ops in spec.items():
            if not isinstance(ops, Mapping):
                raise TemplateError(f"constraints for {short(variable, 40)} must be a mapping such as {{in: [a, b]}}")
            out.extend(Constraint(str(variable), str(op), arg) for op, arg in ops.items())
        return out
    if isinstance(spec, list):
        out = []
        for item in spec:
            if not isinstance(item, Mapping) or set(item) != {"variable", "op", "arg"}:
                raise TemplateError(f"constraint record {short(item)} needs exactly variable, op and arg")
            out.append(Constraint(str(item["variable"]), str(item["op"]), item["arg"]))
        return out
    raise TemplateError("constraints must be a mapping or a list of records")


@dataclass(frozen=True)
class Validation:
    """Whether a candidate template is usable, and why not."""

    ok: bool
    reasons: tuple[str, ...] = ()
    template: Template | None = None
    tokens: int | None = None


def validate_candidate(
    text: str,
    required: Iterable[str],
    max_tokens: int,
    count_tokens: Callable[[str], int] | None = None,
) -> Validation:
    """Decide whether untrusted ``text`` is a usable template: exactly the ``required`` placeholders,
    each once, no other braces, and at most ``max_tokens`` tokens (when a counter is given).
    Never raises for bad text: the reasons say what is wrong."""
    required = tuple(required)
    try:
        template = Template(text, required)
    except TemplateError as exc:
        return Validation(False, (str(exc),))
    if not text.strip():
        return Validation(False, ("template is empty",))
    tokens = None
    if count_tokens is not None:
        tokens = int(count_tokens(text))
        if tokens > max_tokens:
            return Validation(False, (f"template has {tokens} tokens, over the budget of {max_tokens}",), None, tokens)
    return Validation(True, (), template, tokens)
