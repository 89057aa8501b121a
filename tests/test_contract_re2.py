"""Output contracts on RE2 (issue #40, item 4): a pattern from a task file runs on model answers in time linear in
the answer, a pattern RE2 cannot express is refused when the file is read (one line, exit 2 from the CLI), and
where Python's ``re`` and RE2 both accept a pattern they give the same result; the few places they differ
(``templates/patterns.py``) are pinned here so a change to them is a decision, not an accident."""

import faulthandler
import json
import pickle
import re
import shutil
import warnings
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pipelines.cli import main
from pipelines.config import ConfigError, load_task
from templates import patterns
from templates.contract import ContractError, OutputContract, Parsed, short

DATA = Path(__file__).parent / "data"
PROPERTY = settings(max_examples=500, deadline=5000, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.fixture
def hang_guard():
    """The project has no pytest-timeout: should these patterns ever run on a backtracking engine again, the test
    process ends after 120 s with every thread's traceback (faulthandler's watchdog thread fires even while a C
    matcher holds the GIL), rather than leaving the run hanging."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


# --- linear time on hostile answers -------------------------------------------------------------------------------
# Each of these backtracks exponentially in Python's re on a long run of "a" that cannot match: (a+)+$ on
# "a" * 30 + "!" backtracks about 2**30 times there, and on 5,000 it would never finish. RE2 answers in microseconds. No wall
# time is asserted (machines are shared); the test would hang, and hang_guard end it, if the engine regressed.
CATASTROPHIC = ["(a+)+$", "(a|aa)+b", "(a*)*c", "^(a|a)*$", r"^(\w+\s?)*$", "(?:a+){2,}!?x"]
HOSTILE = "a" * 5000 + "!"


@pytest.mark.parametrize("pattern", CATASTROPHIC)
def test_a_catastrophic_pattern_gives_the_no_match_result_on_a_long_hostile_answer(hang_guard, pattern):
    whole = OutputContract("regex", pattern=pattern, max_chars=10_000)
    first = OutputContract("regex", pattern=pattern, extract="first", max_chars=10_000)
    schema = OutputContract("json", schema={"type": "string", "pattern": pattern}, max_chars=10_000)
    assert whole.parse(HOSTILE) == Parsed(False, None, f"answer {short(HOSTILE)} does not match pattern "
                                          f"{short(pattern, 40)}")
    assert first.parse(HOSTILE) == Parsed(False, None, f"no match of the pattern {short(pattern, 40)} in the answer")
    assert schema.parse(json.dumps(HOSTILE)) == Parsed(False, None, f"$: {short(HOSTILE)} does not match pattern "
                                                       f"{short(pattern, 40)}")
    assert not patterns.fullmatch(pattern, HOSTILE) and patterns.search(pattern, HOSTILE) is None


def test_a_catastrophic_pattern_still_matches_what_it_should(hang_guard):
    assert OutputContract("regex", pattern="(a+)+$", max_chars=10_000).parse("a" * 5000).ok
    assert OutputContract("regex", pattern="(a|aa)+b", extract="first", max_chars=10_000).parse(
        "x" + "a" * 5000 + "b!").value == "a" * 5000 + "b"


# --- the same results as re where both accept the pattern ---------------------------------------------------------
ATOMS = ["a", "b", "ab", ".", "[ab]", "[^a]", "[a-c]", "[.-]", r"\.", "-", "é", "É", r"\n", " "]
# \d \w \s \b are ASCII in RE2 and Unicode in re: the same only on ASCII text without \v and \x1c-\x1f
CLASS_ATOMS = ["a", "1", "_", ".", r"\d", r"\w", r"\s", r"\D", r"\W", r"\S", r"\b", r"[\d_]", r"[^\w]", "[a-z]+"]
QUANTIFIERS = ["*", "+", "?", "*?", "+?", "??", "{2}", "{1,3}", "{0,2}?", "{2,}"]


def pattern_of(atoms: list[str]) -> st.SearchStrategy:
    """Patterns both engines accept: atoms joined, alternated, grouped and repeated, behind an optional anchor or
    flag. No ``$``: re's also matches before a final newline (pinned in test_where_the_engines_differ)."""
    def grow(inner: st.SearchStrategy) -> st.SearchStrategy:
        return st.one_of(st.tuples(inner, inner).map("".join), st.tuples(inner, inner).map("|".join),
                         inner.map("({})".format), inner.map("(?:{})".format),
                         st.tuples(inner, st.sampled_from(QUANTIFIERS)).map(lambda t: f"(?:{t[0]}){t[1]}"))
    body = st.recursive(st.sampled_from(atoms), grow, max_leaves=8)
    return st.tuples(st.sampled_from(["", "^", r"\A", "(?i)", "(?s)", "(?i)^"]), body).map("".join)


def accepted_by_both(pattern: str) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning (e.g. a possible nested set) means re reads it otherwise
        try:
            re.compile(pattern)
        except (re.error, FutureWarning):
            return False
    return patterns.refusal(pattern) is None


def assert_same_as_re(pattern: str, text: str) -> None:
    assume(accepted_by_both(pattern))
    found = re.search(pattern, text)
    assert patterns.search(pattern, text) == (found.span() if found else None), (pattern, text)
    assert patterns.fullmatch(pattern, text) == (re.fullmatch(pattern, text) is not None), (pattern, text)
    # the contracts as they read answers with re: whole (stripped, fullmatch) and first (search, stripped)
    stripped = text.strip()
    whole = OutputContract("regex", pattern=pattern).parse(text)
    expected_whole = bool(stripped) and re.fullmatch(pattern, stripped) is not None
    assert (whole.ok, whole.value) == (expected_whole, stripped if expected_whole else None), (pattern, text)
    first = OutputContract("regex", pattern=pattern, extract="first").parse(text)
    value = found.group().strip() if found and stripped else ""
    assert (first.ok, first.value) == (bool(value), value or None), (pattern, text)
    schema = OutputContract("json", schema={"type": "string", "pattern": pattern}).parse(json.dumps(text))
    assert schema.ok == (found is not None), (pattern, text)


@PROPERTY
@given(pattern=pattern_of(ATOMS), text=st.text(alphabet="abcAB.-\n éÉ", max_size=12))
def test_re2_and_re_agree_on_patterns_both_accept(pattern, text):
    assert_same_as_re(pattern, text)


@PROPERTY
@given(pattern=pattern_of(CLASS_ATOMS), text=st.text(alphabet="ab1_9Z -.\t\n", max_size=12))
def test_re2_and_re_agree_on_class_escapes_over_ascii_text(pattern, text):
    assert_same_as_re(pattern, text)


@pytest.mark.parametrize("pattern, text", [
    (r"\+?\d(?:[ -]?\d){4,14}", "Call 0800 169 6031 now"),  # the callback task's
    (r"SKU-[0-9]{4}", "  SKU-0042\n"), (r"(?i)yes|no", "No."), (r"^[0-9]+\.[0-9]{2}$", "12.50"),
    (r"(?P<word>\w+)@(\w+)\.com", "mail bob@example.com today"), (r"a*?b", "aaab"), (r"(a|ab)(c|bcd)", "abcd"),
])
def test_re2_and_re_agree_on_patterns_tasks_use(pattern, text):
    assert_same_as_re(pattern, text)


@pytest.mark.parametrize("pattern, text, re2_span, re_span", [
    (r"\d+", "\u0663" + "4", (1, 2), (0, 2)),  # ARABIC-INDIC DIGIT THREE: a digit to re, not to RE2's ASCII \d
    (r"\w+", "é", None, (0, 1)),
    (r"\s", "\v", None, (0, 1)),
    (r"\pN+", "\u0663" + "4", (0, 2), re.error),  # RE2's way to take any digit; re has no \p
    (r"a$", "a\n", None, (0, 1)),  # $ is the very end in RE2 (and in JSON Schema), also before a final \n in re
    (r"a\z", "a", (0, 1), re.error),  # RE2's end of text; re calls it \Z (refused by RE2)
    ("[[:digit:]]", "5", (0, 1), None),  # a POSIX class in RE2; re (with a FutureWarning) a set of "[:digt" and "]"
    (r"\B", "", (0, 0), None),  # re before Python 3.14 did not match \B in an empty text
])
def test_where_the_engines_differ(pattern, text, re2_span, re_span):
    """The differences templates/patterns.py lists: RE2's behaviour is the contract's now."""
    assert patterns.search(pattern, text) == re2_span
    if re_span is re.error:
        with pytest.raises(re.error):
            re.compile(pattern)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            found = re.search(pattern, text)
        assert (found.span() if found else None) == re_span


def test_a_lone_surrogate_in_a_json_string_is_matched_as_a_replacement_character():
    # json.loads turns "\ud800" into a lone surrogate, which UTF-8 (RE2's input) cannot hold
    contract = OutputContract("json", schema={"type": "string", "pattern": "^a.b$"})
    assert contract.parse('"a\\ud800b"') == Parsed(True, "a\ud800b")
    assert "does not match" in OutputContract("json", schema={"pattern": "^[a-z]+$"}).parse('"a\\ud800b"').reason


def test_a_contract_compiles_its_pattern_once_and_still_pickles_as_text():
    contract = OutputContract("regex", pattern=r"SKU-[0-9]{5}q")  # a pattern no other test compiles
    misses = patterns.compile_pattern.cache_info().misses
    assert all(contract.parse(f"SKU-{i:05d}q").ok for i in range(50))
    assert patterns.compile_pattern.cache_info().misses == misses
    assert pickle.loads(pickle.dumps(contract)) == contract and contract.to_dict()["pattern"] == r"SKU-[0-9]{5}q"


# --- what RE2 cannot express is refused when the contract (the task file) is read ---------------------------------
REFUSED = [
    (r"(a)\1", r"RE2 cannot express backreferences (invalid escape sequence: \1)"),
    (r"(?P<x>a)(?P=x)", "RE2 cannot express backreferences ((?P=name))"),
    ("(?=a)a", "RE2 cannot express lookahead (invalid perl operator: (?=)"),
    ("(?!a)b", "RE2 cannot express lookahead (invalid perl operator: (?!)"),
    ("(?<=a)b", "RE2 cannot express lookbehind (invalid perl operator: (?<=)"),
    ("(?<!a)b", "RE2 cannot express lookbehind (invalid perl operator: (?<!)"),
    ("(?>a+)b", "RE2 has no atomic groups or possessive quantifiers"),
    ("a*+b", "RE2 has no atomic groups or possessive quantifiers"),
    ("a{2}+b", "RE2 has no atomic groups or possessive quantifiers"),
    (r"a\Z", r"RE2 has no \Z (invalid escape sequence: \Z); write \z for the end of the text"),
    ("a{1001}", "RE2 allows repetition counts up to 1000"),
    (r"\u00e9", r"RE2 has no \u, \U or \N escapes (invalid escape sequence: \u); write \x{e9}"),
    # both compile these, to different patterns: RE2 reads the count as literal text
    ("a{,3}", "RE2 reads {,3} as literal text, not as 0 to 3 repetitions; write {0,3}"),
    ("[{]a{,}", "RE2 reads {,} as literal text, not as 0 to any number of repetitions; write *"),
]


@pytest.mark.parametrize("pattern", [r"a\{,3}", "[a{,3}]", "[]{,3}]", r"[\]{,3}]", "{,3}", "a{0,3}", "a{3,}"])
def test_an_escaped_brace_a_class_or_a_full_count_is_not_refused(pattern):
    assert patterns.refusal(pattern) is None


@pytest.mark.parametrize("pattern, reason", REFUSED)
def test_a_pattern_re2_cannot_express_is_refused_in_one_line_naming_it_the_reason_and_the_fix(pattern, reason):
    re.compile(pattern)  # Python's re took each of these: a task file that loaded before is refused now, by name
    for make, where in [(lambda: OutputContract("regex", pattern=pattern), "pattern "),
                        (lambda: OutputContract("regex", pattern=pattern, extract="first"), "pattern "),
                        (lambda: OutputContract("json", schema={"type": "object", "properties": {
                            "id": {"type": "string", "pattern": pattern}}}), "json schema at $.properties.id: pattern "),
                        (lambda: OutputContract.from_dict({"kind": "regex", "pattern": pattern}), "pattern ")]:
        with pytest.raises(ContractError) as refused:
            make()
        message = str(refused.value)
        assert message.startswith(f"{where}{pattern!r}: {reason}"), message
        assert "RE2 syntax" in message and len(message.splitlines()) == 1 and len(message) < 300


def generation_task(tmp_path: Path, contract: dict) -> Path:
    """tests/data/transactions_json.yaml (a user's generation task) with its data, under another contract."""
    task = yaml.safe_load((DATA / "transactions_json.yaml").read_text())
    task["output"]["contract"] = contract
    shutil.copy(DATA / "transactions_json.jsonl", tmp_path / "transactions_json.jsonl")
    path = tmp_path / "task.yaml"
    path.write_text(yaml.safe_dump(task))
    return path


BAD_CONTRACTS = [
    ({"kind": "regex", "pattern": r"(a)\1"}, r"output.contract: pattern '(a)\\1': RE2 cannot express backreferences"),
    ({"kind": "regex", "extract": "first", "pattern": r"(?<!\d)\d{5}"},
     r"output.contract: pattern '(?<!\\d)\\d{5}': RE2 cannot express lookbehind"),
    ({"kind": "json", "schema": {"type": "object", "properties": {"merchant": {"type": "string", "pattern": "(?=x)"}}}},
     "output.contract: json schema at $.properties.merchant: pattern '(?=x)': RE2 cannot express lookahead"),
]


@pytest.mark.parametrize("contract, words", BAD_CONTRACTS)
def test_a_task_file_with_such_a_pattern_is_refused_when_it_is_read(tmp_path, contract, words):
    with pytest.raises(ConfigError) as refused:
        load_task(str(generation_task(tmp_path, contract)))
    assert words in str(refused.value) and len(str(refused.value).splitlines()) == 1


@pytest.mark.parametrize("command", [["validate"], ["render", "--task"], ["--estimate", "--task"]])
@pytest.mark.parametrize("contract, words", BAD_CONTRACTS)
def test_the_cli_exits_2_with_one_line_on_such_a_task_file(tmp_path, capsys, command, contract, words):
    try:
        code = main([*command, str(generation_task(tmp_path, contract))])
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2, captured
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured
    assert "Traceback" not in captured.err and words in captured.err and "rewrite it in RE2 syntax" in captured.err


def test_the_same_task_file_with_an_re2_pattern_loads():
    contract = load_task("callback").output.output_contract()
    assert contract.kind == "regex" and patterns.refusal(contract.pattern) is None
