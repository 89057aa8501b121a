"""Regular expressions that come from a task file and run on text from outside: one RE2 helper for the input
constraints (``templates.template``) and the output contracts (``templates.contract``).

Both the pattern (a user's task file, a stored record) and the text it runs on (an input value, a model's answer)
are outside the project's control. Python's ``re`` backtracks: ``(a+)+$`` on ``'a' * 30 + '!'`` backtracks about
2**30 times and each further ``a`` doubles that, so one answer could stall scoring. RE2 matches in time linear in
the text whatever the pattern, and gives the same matches as ``re`` for a pattern both accept, except:

* ``\\d``, ``\\w``, ``\\s`` and ``\\b`` are ASCII: ``[0-9]``, ``[0-9A-Za-z_]``, ``[\\t\\n\\f\\r ]`` (no ``\\v``),
  where ``re`` takes any Unicode digit, letter or space; write ``\\pN``, ``\\pL`` or a class to take more;
* ``$`` without ``(?m)`` matches only at the very end, where ``re`` also matches before a final newline (JSON
  Schema's ``pattern`` means the former);
* ``[[:digit:]]`` is a POSIX class (``re`` read it as a set of the characters ``[:digt`` then a ``]``), and ``\\B``
  matches an empty text (``re`` before Python 3.14 did not).

What RE2 cannot express (backreferences, lookaround, atomic groups, possessive quantifiers, ``\\Z``, repetition
counts over 1000) is refused when the pattern is read, by ``refusal``, with the fix; so is ``{,n}``, which ``re``
reads as ``{0,n}`` and RE2 as literal text.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import re2

OPTIONS = re2.Options()
OPTIONS.log_errors = False  # RE2 would also write each refused pattern to stderr

_SURROGATE = re.compile("[\ud800-\udfff]")
_ZERO_TO = re.compile(r"\{,[0-9]*\}")  # re's {,n} and {,}: 0 to n, 0 or more
_REWRITE = "rewrite it in RE2 syntax, without backreferences or lookaround"
# RE2's message for a pattern it refuses -> what RE2 lacks, and the fix. Matched in order on the message.
_LACKS = (
    (re.compile(r"invalid escape sequence: \\[1-9]"), "RE2 cannot express backreferences", _REWRITE),
    (re.compile(r"invalid perl operator: \(\?[=!]"), "RE2 cannot express lookahead", _REWRITE),
    (re.compile(r"invalid perl operator: \(\?<[=!]"), "RE2 cannot express lookbehind", _REWRITE),
    (re.compile(r"invalid perl operator: \(\?>|bad repetition operator: \S*[*+?}]\+"),
     "RE2 has no atomic groups or possessive quantifiers", "drop them: RE2 never backtracks (RE2 syntax)"),
    (re.compile(r"invalid escape sequence: \\Z"), "RE2 has no \\Z", "write \\z for the end of the text (RE2 syntax)"),
    (re.compile(r"invalid escape sequence: \\[uUN]"), "RE2 has no \\u, \\U or \\N escapes",
     "write \\x{e9} for U+00E9, or the character itself (RE2 syntax)"),
    (re.compile(r"invalid repetition size"), "RE2 allows repetition counts up to 1000",
     "use a smaller count, or + (RE2 syntax)"),
)


@functools.lru_cache(maxsize=256)
def compile_pattern(pattern: str) -> Any:
    """``pattern`` compiled by RE2, once per process: callers hold only the text, so their records pickle, compare
    and hash as text. Raises ``re2.error``, or UnicodeEncodeError for a lone surrogate (not UTF-8)."""
    return re2.compile(pattern, OPTIONS)


def refusal(pattern: str) -> str | None:
    """None when RE2 compiles ``pattern`` to what ``re`` meant by it; else why not and the fix, one line, e.g.
    "RE2 cannot express lookahead (invalid perl operator: (?=); rewrite it in RE2 syntax, without backreferences
    or lookaround"."""
    try:
        compile_pattern(pattern)
    except UnicodeEncodeError:
        return "it holds a lone surrogate, which is not text; write the character itself (RE2 syntax)"
    except re2.error as exc:
        arg = exc.args[0] if exc.args else ""
        message = " ".join((arg.decode("utf-8", "replace") if isinstance(arg, bytes) else str(arg)).split())[:60]
        if message.startswith("invalid perl operator: (?P") and "(?P=" in pattern:  # RE2 names only the "(?P"
            return f"RE2 cannot express backreferences ((?P=name)); {_REWRITE}"
        for found, lacks, fix in _LACKS:
            if found.search(message):
                return f"{lacks} ({message}); {fix}"
        return f"RE2 refuses it ({message}); write it in RE2 syntax (no backreferences or lookaround)"
    count = _zero_to(pattern)
    if count:
        most = count[2:-1]
        return (f"RE2 reads {count} as literal text, not as 0 to {most or 'any number of'} repetitions; write "
                + (f"{{0,{most}}}" if most else "*") + " (RE2 syntax)")
    return None


def _zero_to(pattern: str) -> str | None:
    """The first ``{,n}`` or ``{,}`` that ``re`` reads as a repetition (after an item, outside a class, not
    escaped), or None: RE2 reads it as literal text, so the pattern would compile and silently mean another."""
    i, in_class = 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
            i += 1 + (pattern.startswith("^", i + 1))
            i += pattern.startswith("]", i)  # "[]" and "[^]" begin a class holding "]"
            continue
        elif ch == "{" and i > 0:
            found = _ZERO_TO.match(pattern, i)
            if found:
                return found.group()
        i += 1
    return None


def utf8_safe(text: str) -> str:
    """``text`` with each lone surrogate (JSON data and answers may carry "\\ud800") as U+FFFD: RE2 matches UTF-8,
    which cannot hold one. One character for one, so match positions are positions in ``text``."""
    return _SURROGATE.sub("\ufffd", text)


def fullmatch(pattern: str, text: str) -> bool:
    """Whether all of ``text`` matches ``pattern`` (which ``refusal`` passed), in time linear in ``text``."""
    return compile_pattern(pattern).fullmatch(utf8_safe(text)) is not None


def search(pattern: str, text: str) -> tuple[int, int] | None:
    """The span of the first (leftmost, as ``re.search``) match of ``pattern`` in ``text``, or None."""
    found = compile_pattern(pattern).search(utf8_safe(text))
    return None if found is None else found.span()
