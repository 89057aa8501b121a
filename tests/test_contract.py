"""The output contract: an answer that breaks it is data with a reason, never a crash."""

import json
import random

import pytest

from templates.contract import ContractError, OutputContract, Parsed

YES_NO = OutputContract("labels", labels=("positive", "negative"), words=("yes", "no"))
EXACT = OutputContract("labels", labels=("positive", "negative"), words=("yes", "no"), rule="exact")
PRODUCT = OutputContract("json", schema={
    "type": "object",
    "required": ["name", "price", "tags"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 10},
        "price": {"type": "string", "pattern": "^[0-9]+\\.[0-9]{2}$"},
        "currency": {"enum": ["EUR", "USD"]},
        "stock": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3, "uniqueItems": True},
        "note": {"type": ["string", "null"], "description": "free text"},
        "version": {"const": 1},
    },
})
GOOD_PRODUCT = {"name": "Lamp", "price": "12.50", "currency": "EUR", "stock": 3, "tags": ["home"], "note": None,
                "version": 1}
DROP = object()  # a change that removes the field
SKU = OutputContract("regex", pattern=r"SKU-[0-9]{4}")


@pytest.mark.parametrize("answer", ["Yes", "yes.", "**Yes**", "\"YES\"", "- yes", "[yes] it is", "Yes, it is.",
                                    "  \n yes\n", b"yes"])
def test_first_word_yes(answer):
    assert YES_NO.parse(answer) == Parsed(True, "positive")


@pytest.mark.parametrize("answer", ["No", "**No**", " no, because it is late", "'no'"])
def test_first_word_no(answer):
    assert YES_NO.parse(answer) == Parsed(True, "negative")


@pytest.mark.parametrize("answer, reason", [
    ("Yesterday it was", "first word 'Yesterday' is not one of the label words yes/no"),
    ("maybe", "first word 'maybe' is not one of the label words yes/no"),
    ("Absolutelyyyyyyyyyyyyyyyyyy", "first word 'Absolutelyyyyyyyyyyy...' is not one of the label words yes/no"),
    ("**?!", "no words in the answer"),
])
def test_first_word_failures(answer, reason):
    assert YES_NO.parse(answer) == Parsed(False, None, reason)


def test_first_word_cut_off_at_the_token_limit():
    assert YES_NO.parse("Ye", truncated=True).reason == "cut off at the token limit"
    assert YES_NO.parse("Yes", truncated=True).reason == "cut off at the token limit"  # maybe "Yesterday"
    assert YES_NO.parse("Yes,", truncated=True) == Parsed(True, "positive")
    assert YES_NO.parse("No because the", truncated=True) == Parsed(True, "negative")


@pytest.mark.parametrize("answer, value", [("Yes.", "positive"), ("  no!\n", "negative"), ("**YES**", "positive"),
                                           ("(no)", "negative"), ("`yes`", "positive")])
def test_exact_rule_accepts_one_word_with_punctuation(answer, value):
    assert EXACT.parse(answer) == Parsed(True, value)


@pytest.mark.parametrize("answer", ["yes no", "Yes, it is", "yesterday", "maybe"])
def test_exact_rule_refuses_anything_else(answer):
    parsed = EXACT.parse(answer)
    assert not parsed.ok and parsed.value is None
    assert parsed.reason.endswith("is not one of the label words yes/no")


def test_exact_rule_refuses_a_cut_off_answer():
    assert EXACT.parse("Yes.", truncated=True).reason == "cut off at the token limit"


@pytest.mark.parametrize("contract", [YES_NO, EXACT, PRODUCT, SKU])
@pytest.mark.parametrize("answer", [None, "", "   \n\t", b"", b"  "])
def test_empty_answers(contract, answer):
    assert contract.parse(answer) == Parsed(False, None, "empty answer")


@pytest.mark.parametrize("contract", [YES_NO, EXACT, PRODUCT, SKU])
@pytest.mark.parametrize("answer", [b"\xff\xfe", b"yes \xc3", "yes \udcff", "\ud800"])
def test_invalid_utf8(contract, answer):
    assert contract.parse(answer) == Parsed(False, None, "invalid UTF-8")


def test_answers_that_are_not_text_fail():
    assert YES_NO.parse(42).reason == "answer is not text but int"


@pytest.mark.parametrize("contract", [YES_NO, EXACT, PRODUCT, SKU])
def test_over_long_answers(contract):
    assert contract.parse("yes " + "x" * 4000).reason == "answer longer than 4000 characters"
    short = OutputContract.from_dict({**contract.to_dict(), "max_chars": 10})
    assert short.parse("y" * 11).reason == "answer longer than 10 characters"


def test_a_valid_json_object():
    assert PRODUCT.parse(json.dumps(GOOD_PRODUCT)) == Parsed(True, GOOD_PRODUCT)
    minimal = {"name": "L", "price": "1.00", "tags": ["a", "b", "c"], "stock": 2.0, "note": "ok"}
    assert PRODUCT.parse(json.dumps(minimal)).ok


@pytest.mark.parametrize("answer", [
    "```json\n" + json.dumps(GOOD_PRODUCT) + "\n```",
    "```\n" + json.dumps(GOOD_PRODUCT) + "\n```",
    "  ```JSON " + json.dumps(GOOD_PRODUCT) + "```\n",
])
def test_fenced_json_is_accepted(answer):
    assert PRODUCT.parse(answer) == Parsed(True, GOOD_PRODUCT)


@pytest.mark.parametrize("change, reason", [
    ({"name": DROP}, "$: missing required field 'name'"),
    ({"name": 5}, "$.name: expected string, got integer"),
    ({"name": ""}, "$.name: '' is shorter than minLength 1"),
    ({"name": "a very long name"}, "$.name: 'a very long name' is longer than maxLength 10"),
    ({"price": "abc"}, "$.price: 'abc' does not match pattern '^[0-9]+\\\\.[0-9]{2}$'"),
    ({"currency": "GBP"}, "$.currency: 'GBP' is not one of [\"EUR\", \"USD\"]"),
    ({"stock": -1}, "$.stock: -1 is below minimum 0"),
    ({"stock": 101}, "$.stock: 101 is above maximum 100"),
    ({"stock": 1.5}, "$.stock: expected integer, got number"),
    ({"stock": True}, "$.stock: expected integer, got boolean"),
    ({"tags": []}, "$.tags: 0 items, fewer than minItems 1"),
    ({"tags": ["a", "b", "c", "d"]}, "$.tags: 4 items, more than maxItems 3"),
    ({"tags": ["a", "b", "a"]}, "$.tags[2]: duplicate of $.tags[0]"),
    ({"tags": ["a", 2]}, "$.tags[1]: expected string, got integer"),
    ({"note": 3}, "$.note: expected string/null, got integer"),
    ({"version": True}, "$.version: true is not the constant 1"),
    ({"colour": "red"}, "$: unexpected field 'colour'"),
])
def test_each_schema_violation_fails_with_its_path(change, reason):
    value = {k: v for k, v in {**GOOD_PRODUCT, **change}.items() if v is not DROP}
    assert PRODUCT.parse(json.dumps(value)) == Parsed(False, None, reason)


def test_the_wrong_top_level_type_fails_at_the_root():
    assert PRODUCT.parse("[1, 2]").reason == "$: expected object, got array"


@pytest.mark.parametrize("answer", ["[" * 100_000, '{"a":' * 50_000, "[" * 17 + "]" * 17])
def test_deep_nesting_fails_quickly_without_recursion(answer, best_of):
    wide = OutputContract("json", schema={}, max_chars=1_000_000)
    assert wide.parse(answer) == Parsed(False, None, "JSON nested deeper than 16 levels")
    flat = "[" + ",".join(["0"] * (len(answer) // 2)) + "]"  # as long, and parsed to the end
    assert wide.parse(flat).ok
    assert best_of(lambda: wide.parse(answer)) < 2 * best_of(lambda: wide.parse(flat))
    assert not PRODUCT.parse(answer).ok


def test_nesting_up_to_the_limit_and_brackets_inside_strings_are_fine():
    assert OutputContract("json", schema={}).parse("[" * 16 + "]" * 16).ok
    assert OutputContract("json", schema={}).parse(json.dumps(["[[[[" * 10, "\\\"{{{{" * 10])).ok


@pytest.mark.parametrize("answer, reason", [
    ('{"name": "Lamp", "price": "1', "cut off at the token limit"),
    ("NaN", "not JSON: NaN/Infinity are not JSON"),
    ('{"x": -Infinity}', "not JSON: NaN/Infinity are not JSON"),
    ("1e999", "not JSON: number 1e999 is out of range"),
    ("{'single': 'quotes'}", "not JSON"),
    ("Here is the JSON: {}", "not JSON"),
    ("```json\n{}\n```\nmore", "not JSON"),
])
def test_answers_that_are_not_json(answer, reason):
    any_json = OutputContract("json", schema={})
    assert any_json.parse(answer, truncated=reason.startswith("cut off")) == Parsed(False, None, reason)


def test_a_huge_answer_fails_on_length_without_being_parsed(best_of):
    huge = json.dumps({"text": "x" * 5_000_000})
    assert PRODUCT.parse(huge).reason == "answer longer than 4000 characters"
    assert PRODUCT.parse(huge.encode()).reason == "answer longer than 4000 characters"
    parsing = OutputContract("json", schema={}, max_chars=10_000_000)  # the same answer, read to the end
    assert parsing.parse(huge).ok
    assert best_of(lambda: PRODUCT.parse(huge)) < best_of(lambda: parsing.parse(huge)) / 10


def test_regex_kind():
    assert SKU.parse("  SKU-0042\n") == Parsed(True, "SKU-0042")
    assert SKU.parse("SKU-0042 is the one").reason == (
        "answer 'SKU-0042 is the one' does not match pattern 'SKU-[0-9]{4}'")
    assert not SKU.parse("sku-0042").ok
    assert SKU.parse("SKU-0042", truncated=True).reason == "cut off at the token limit"


@pytest.mark.parametrize("text, done", [("", False), ("Ye", False), ("**", False), ("  **Yes", False),
                                        ("Yes,", True), ("No ", True), ("**Yes*", True), ("maybe\n", True)])
def test_complete_once_the_first_word_has_ended(text, done):
    assert YES_NO.complete(text) is done


@pytest.mark.parametrize("contract", [EXACT, PRODUCT, SKU])
def test_other_contracts_are_never_complete_early(contract):
    assert not contract.complete("Yes, " + json.dumps(GOOD_PRODUCT))


@pytest.mark.parametrize("contract", [YES_NO, EXACT, PRODUCT, SKU,
                                      OutputContract("json", schema={"type": "array"}, max_chars=50, max_depth=3)])
def test_to_dict_round_trips_through_json(contract):
    record = json.loads(json.dumps(contract.to_dict()))
    assert OutputContract.from_dict(record) == contract
    assert OutputContract.from_dict(record).to_dict() == record


def test_to_dict_leaves_out_what_the_kind_does_not_use():
    assert YES_NO.to_dict() == {"kind": "labels", "labels": ["positive", "negative"], "words": ["yes", "no"],
                                "rule": "first_word", "max_chars": 4000}
    assert SKU.to_dict() == {"kind": "regex", "pattern": r"SKU-[0-9]{4}", "max_chars": 4000}
    assert set(PRODUCT.to_dict()) == {"kind", "schema", "max_chars", "max_depth"}


def test_the_schema_is_a_private_copy():
    schema = {"type": "object", "required": ["a"]}
    contract = OutputContract("json", schema=schema)
    schema["required"].append("b")
    contract.to_dict()["schema"]["required"].append("c")
    assert contract.parse('{"a": 1}').ok


def test_describe():
    assert YES_NO.describe() == "first word is one of yes/no (case and surrounding punctuation ignored)"
    assert EXACT.describe() == "the whole answer is one of yes/no (case and surrounding punctuation ignored)"
    assert "name, price, tags" in PRODUCT.describe()
    assert "SKU-[0-9]{4}" in SKU.describe()


@pytest.mark.parametrize("make, message", [
    (lambda: OutputContract("yaml"), "contract kind 'yaml' is not one of"),
    (lambda: OutputContract("labels", labels=("a",), words=("yes",)), "two or more labels"),
    (lambda: OutputContract("labels", labels=("a", "b"), words=("yes",)), "two or more labels"),
    (lambda: OutputContract("labels", labels=("a", "a"), words=("yes", "no")), "distinct"),
    (lambda: OutputContract("labels", labels=("a", "b"), words=("Yes", "yes")), "must differ ignoring case"),
    (lambda: OutputContract("labels", labels=("a", "b"), words=("yes", "not sure")), "one word"),
    (lambda: OutputContract("labels", labels=("a", "b"), words=("yes", "")), "one word"),
    (lambda: OutputContract("labels", labels="ab", words="yn"), "must be a list of strings"),
    (lambda: OutputContract("labels", labels=("a", "b"), words=("y", "n"), rule="last_word"), "rule 'last_word'"),
    (lambda: OutputContract("labels", labels=("a", "b"), words=("y", "n"), pattern="y"), "takes no pattern"),
    (lambda: OutputContract("json"), "must be a mapping"),
    (lambda: OutputContract("json", schema={"type": "object", "format": "date"}), "1 unsupported keyword(s) (the first: format)"),
    (lambda: OutputContract("json", schema={"properties": {"a": {"oneOf": []}}}),
     "json schema at $.properties.a has 1 unsupported keyword(s) (the first: oneOf)"),
    (lambda: OutputContract("json", schema={"type": "float"}), "type must be one of"),
    (lambda: OutputContract("json", schema={"pattern": "("}), "json schema at $: pattern '(': RE2 refuses it"),
    (lambda: OutputContract("json", schema={"pattern": 3}), "pattern must be a regular expression in RE2 syntax"),
    (lambda: OutputContract("json", schema={"additionalProperties": {}}), "additionalProperties must be true or false"),
    (lambda: OutputContract("json", schema={"minItems": -1}), "minItems must be a non-negative integer"),
    (lambda: OutputContract("json", schema={"enum": [float("nan")]}), "must be plain JSON"),
    (lambda: OutputContract("regex", pattern="(unclosed"), "pattern '(unclosed': RE2 refuses it"),
    (lambda: OutputContract("regex"), "a pattern that compiles"),
    (lambda: OutputContract("regex", pattern="x", max_chars=0), "max_chars=0 must be a positive integer"),
    (lambda: OutputContract("json", schema={}, max_depth=True), "max_depth=True must be a positive integer"),
    (lambda: OutputContract.from_dict({"kind": "regex", "pattern": "x", "flags": "i"}), "1 unknown field(s) (the first: flags)"),
    (lambda: OutputContract.from_dict(["labels"]), "must be a mapping with a kind"),
])
def test_bad_definitions_raise_contract_error(make, message):
    with pytest.raises(ContractError) as error:
        make()
    assert message in str(error.value)


def _random_answer(rng: random.Random) -> str | bytes:
    """Noise, valid JSON with a few characters changed, or random bytes."""
    roll = rng.random()
    if roll < 0.2:
        return bytes(rng.randint(0, 255) for _ in range(rng.randint(0, 60)))
    if roll < 0.4:
        text = list(json.dumps(GOOD_PRODUCT))
        for _ in range(rng.randint(0, 3)):
            text[rng.randrange(len(text))] = rng.choice(['"', "{", "]", "1", " ", "x", ""])
        return "".join(text)
    pieces = ["yes", "No", "```json", "```", "{", "}", "[", "]", '"', "'", "\\", ":", ",", "*", " ", "\n", "\t",
              "\x00", "\x1b", "\u200b", "\ufeff", "NaN", "-Infinity", "1e999", "SKU-0042", "null", "true"]
    parts = []
    for _ in range(rng.randint(0, 40)):
        roll = rng.random()
        if roll < 0.5:
            parts.append(rng.choice(pieces))
        elif roll < 0.8:
            parts.append(chr(rng.randint(0, 0x10FFFF)))
        else:
            parts.append(chr(rng.randint(32, 126)) * rng.randint(1, 30))
    if rng.random() < 0.05:
        parts.insert(rng.randint(0, len(parts)), "\udcff")  # a lone surrogate
    text = "".join(parts)
    return text.encode("utf-8", "surrogatepass") if rng.random() < 0.1 else text


@pytest.mark.parametrize("contract", [YES_NO, EXACT, PRODUCT, SKU, OutputContract("json", schema={})])
def test_parse_never_raises_on_random_answers(contract):
    rng = random.Random(20240607)
    for _ in range(2000):
        answer = _random_answer(rng)
        truncated = rng.random() < 0.2
        parsed = contract.parse(answer, truncated=truncated)
        assert isinstance(parsed, Parsed)
        assert parsed.ok == (parsed.reason == "")
        assert parsed.ok or parsed.value is None
        contract.complete(answer if isinstance(answer, str) else "")


# --- json, extract: first: the first object or array in the answer, text around it ignored ----------------------
FIRST = OutputContract("json", schema=PRODUCT.schema, extract="first")


@pytest.mark.parametrize("answer", [
    json.dumps(GOOD_PRODUCT),
    "JSON:\n" + json.dumps(GOOD_PRODUCT, indent=2) + "\n\nThis JSON object describes the lamp.",
    "```json\n" + json.dumps(GOOD_PRODUCT) + "\n```",
    'Sure! {"name": "Lamp", "price": "12.50", "tags": ["a}b", "{"]} and {"name": "other"}',
])
def test_extract_first_takes_the_first_value_and_ignores_the_text_around_it(answer):
    parsed = FIRST.parse(answer)
    assert parsed.ok and parsed.value["name"] == "Lamp"
    assert FIRST.complete(answer)


@pytest.mark.parametrize("answer, truncated, reason", [
    ('JSON: {"name": "Lamp", "price": "12.5', True, "cut off at the token limit"),
    ('JSON: {"name": "Lamp", "price": "12.5', False, "the JSON value is not closed"),
    ("I cannot help with that.", False, "no JSON object or array in the answer"),
    ('{"name": "Lamp", "price": "12.5", "tags": ["x"]} trailing', False, "does not match pattern"),
    ('{"name": "Lamp", "price": "12.50", "tags": ["x"], "color": "red"} ok', False, "unexpected field"),
    ('{"a": ' * 20 + "1" + "}" * 20, False, "nested deeper than 16 levels"),
])
def test_extract_first_still_holds_the_value_to_its_schema(answer, truncated, reason):
    parsed = FIRST.parse(answer, truncated=truncated)
    assert not parsed.ok and reason in parsed.reason


def test_extract_first_a_value_closed_before_the_token_limit_counts_and_generation_may_stop_there():
    answer = json.dumps(GOOD_PRODUCT) + "\n\nThis JSON contains"
    assert FIRST.parse(answer, truncated=True).ok and not PRODUCT.parse(answer, truncated=True).ok
    assert not FIRST.complete('JSON: {"name": "La') and not FIRST.complete("Here it is:")
    assert FIRST.complete('{"name": "a]}"}')


def test_extract_first_is_fast_on_deep_and_huge_answers_and_round_trips(best_of):
    deep = "x " + "[" * 100_000
    assert not FIRST.parse(deep).ok
    assert FIRST.parse("{" * 3000 + "}" * 3000).reason == "answer longer than 4000 characters"
    reading = OutputContract("json", schema={}, extract="first", max_chars=1_000_000)  # a flat answer as long
    flat = "x " + json.dumps(list(range(len(deep) // 7)))
    assert reading.parse(flat).ok
    assert best_of(lambda: FIRST.parse(deep)) < 2 * best_of(lambda: reading.parse(flat))
    assert OutputContract.from_dict(json.loads(json.dumps(FIRST.to_dict()))) == FIRST
    assert "extract" not in PRODUCT.to_dict()  # whole-answer records (and their content hashes) are as before
    assert "first JSON value" in FIRST.describe()
    with pytest.raises(ContractError, match="extract"):
        OutputContract("json", schema={}, extract="last")
    with pytest.raises(ContractError, match="takes no extract"):
        OutputContract("labels", labels=("a", "b"), words=("yes", "no"), extract="first")


PHONE = OutputContract("regex", pattern=r"\+?\d(?:[ -]?\d){4,14}", extract="first")


def test_regex_extract_first_reads_the_first_match_anywhere_in_the_answer():
    assert PHONE.parse("The phone number in this message is 09061701461.").value == "09061701461"
    assert PHONE.parse("Text 87121 or call 0800 169 6031").value == "87121"
    assert PHONE.parse("Call 0800 169 6031 now").value == "0800 169 6031"
    whole = OutputContract("regex", pattern=r"\+?\d(?:[ -]?\d){4,14}")
    assert not whole.parse("The number is 87121.").ok and whole.parse(" 87121 ").ok
    assert PHONE.parse("There is no number in this message.").reason.startswith("no match of the pattern")
    assert not PHONE.parse("It is 1234, I think").ok  # four digits are not a number here


def test_regex_extract_first_at_the_token_limit_is_cut_off_unless_the_match_ended_before_it():
    assert PHONE.parse("The number is 0906170", truncated=True).reason == "cut off at the token limit"
    assert PHONE.parse("The number is", truncated=True).reason == "cut off at the token limit"
    assert PHONE.parse("The number is 09061701461. It costs", truncated=True).value == "09061701461"
    assert not PHONE.complete("The number is 09061701461.")  # a regex answer runs to its end or its limit


def test_regex_extract_first_round_trips_and_describes_itself_and_whole_records_are_unchanged(best_of):
    assert OutputContract.from_dict(json.loads(json.dumps(PHONE.to_dict()))) == PHONE
    assert "extract" not in OutputContract("regex", pattern="x").to_dict()  # earlier records keep their hashes
    assert "first match" in PHONE.describe()
    long, short = "12a " * 990 + "12345", "12a " * 247 + "12345"
    assert PHONE.parse(long).value == "12345" == PHONE.parse(short).value  # found at the end of a long answer
    # in linear time: four times the answer, about four times the time (a quadratic search: sixteen)
    assert best_of(lambda: PHONE.parse(long), 5) < 8 * best_of(lambda: PHONE.parse(short), 5)
