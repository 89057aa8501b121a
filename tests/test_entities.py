"""Entities for entity_consistency: what is found in UK SMS, how a swap keeps types and shape, what counts as
the same value, and that no input makes the patterns raise or crawl."""

import datetime
import random
import re

import pytest

from rewards.entities import ENTITY_TYPES, Entity, find_entities, normalize, swap_entities, unsupported_entities

SMS = [
    "WINNER!! As a valued network customer you have been selected to receivea £900 prize reward! To claim call "
    "09061701461. Claim code KL341. Valid 12 hours only.",
    "Please call our customer service representative on 0800 542 0825 between 10am-9pm as you have WON a "
    "guaranteed £1000 cash or £5000 prize!",
    "SIX chances to win CASH! From 100 to 20,000 pounds txt> CSH11 and send to 87575. Cost 150p/day, 6days, 16+ "
    "TsandCs apply Reply HL 4 info",
    "URGENT! Your mobile No. +44 7700 900123 won £1,500.00! Visit www.getzed.co.uk or http://tinyurl.com/xyz by "
    "12/05/2024. Queries: info@bank.co.uk",
    "Free entry in 2 a wkly comp to win FA Cup final tkts 21st May 2005. Text FA to 87121 to receive entry "
    "question(std txt rate)T&C's apply 08452810075over18's",
    "Your loan of $500 (or €20 a week) is approved on March 3, 2024; pay 1,000 back by 2024-03-12 at bank.com/pay",
    "Thanks for your subscription to Ringtone UK your mobile will be charged £1.50/wk. Call +44 (0)20 7946 0958.",
]


def found(text):
    return [(e.type, e.value) for e in find_entities(text)]


# ---------------------------------------------------------------- finding


@pytest.mark.parametrize("text, expected", [
    ("To claim call 09061701461. Claim code KL341.", [("phone", "09061701461")]),
    ("Freephone 0800 542 0825 now", [("phone", "0800 542 0825")]),
    ("Ring +44 7700 900123 or +447700900123", [("phone", "+44 7700 900123"), ("phone", "+447700900123")]),
    ("call (0800) 542-0825 or 07700-900-123", [("phone", "(0800) 542-0825"), ("phone", "07700-900-123")]),
    ("(call 0800 542 0825)", [("phone", "0800 542 0825")]),
    ("CALL09061701461 now", [("phone", "09061701461")]),
    ("txt WIN to 87121 or Send STOP to 62468", [("phone", "87121"), ("phone", "62468")]),
    ("£1000 cash, £1.50/wk, $500, €20", [("amount", "£1000"), ("amount", "£1.50"), ("amount", "$500"),
                                         ("amount", "€20")]),
    ("150p/msg, 20 pounds, 50 dollars, 100 EUR, GBP 1,000", [("amount", "150p"), ("amount", "20 pounds"),
                                                             ("amount", "50 dollars"), ("amount", "100 EUR"),
                                                             ("amount", "GBP 1,000")]),
    ("by 12/05/2024 or 2024-03-12", [("date", "12/05/2024"), ("date", "2024-03-12")]),
    ("on 3rd March, March 3, 2024 or 3 March 2024", [("date", "3rd March"), ("date", "March 3, 2024"),
                                                     ("date", "3 March 2024")]),
    ("ends 21st May 2005 or 3-Mar-24", [("date", "21st May 2005"), ("date", "3-Mar-24")]),
    ("Visit www.getzed.co.uk or http://tinyurl.com/xyz.", [("url", "www.getzed.co.uk"),
                                                          ("url", "http://tinyurl.com/xyz")]),
    ("see getzed.co.uk, bank.com/path or WWW.Bank.com/!", [("url", "getzed.co.uk"), ("url", "bank.com/path"),
                                                           ("url", "WWW.Bank.com/")]),
    ("Queries: info@bank.co.uk.", [("email", "info@bank.co.uk")]),
    ("1,000 winners, 12 hrs, 0.5 or 16+", [("number", "1,000"), ("number", "12"), ("number", "0.5"),
                                           ("number", "16")]),
])
def test_each_type_is_found_in_sms_wording(text, expected):
    assert found(text) == expected


@pytest.mark.parametrize("text, expected", [
    # A URL's digits are not a phone number or a number, an email's host is not a URL.
    ("http://tinyurl.com/09061701461", [("url", "http://tinyurl.com/09061701461")]),
    ("mail john.me@bank.com", [("email", "john.me@bank.com")]),
    # A phone number's digits are not numbers; an amount is one amount.
    ("0800 542 0825", [("phone", "0800 542 0825")]),
    ("£1,500.00", [("amount", "£1,500.00")]),
    # A date's digits are neither a phone number nor numbers.
    ("01-02-2024", [("date", "01-02-2024")]),
    # A phone number ends where it is complete: the next number is another one, and "2" is a word.
    ("call 09061701461 2 claim or 0800 542 0825", [("phone", "09061701461"), ("number", "2"),
                                                   ("phone", "0800 542 0825")]),
])
def test_earlier_types_win_overlaps(text, expected):
    assert found(text) == expected


@pytest.mark.parametrize("text", [
    "claim code KL341", "luv 4U", "c u 2day", "txt CSH11 now", "POBOX 4403LDNW1A7RW18", "6days", "10am-9pm",
    "std txt rate)T&C's", "Reply HL4 info",
])
def test_codes_and_text_speak_are_not_numbers(text):
    assert found(text) == []


def test_a_lower_case_may_is_a_verb_a_capital_one_a_month():
    assert found("i may 2 go") == [("number", "2")]
    assert found("on 2 May") == [("date", "2 May")]


def test_entities_are_in_reading_order_and_cover_their_text():
    for text in SMS:
        entities = find_entities(text)
        assert entities, text
        assert all(text[e.start:e.end] == e.value and e.type in ENTITY_TYPES for e in entities)
        assert all(a.end <= b.start for a, b in zip(entities, entities[1:]))


def test_no_entities():
    assert find_entities("") == []
    assert find_entities("Ok lar... Joking wif u oni...") == []


# ---------------------------------------------------------------- swapping


def gaps(text, entities):
    """The text between and around the entities."""
    bounds = [0] + [x for e in entities for x in (e.start, e.end)] + [len(text)]
    return [text[a:b] for a, b in zip(bounds[::2], bounds[1::2])]


def assert_swap_keeps_shape(text, seed):
    before = find_entities(text)
    swapped = swap_entities(text, seed)
    after = find_entities(swapped)
    assert [e.type for e in after] == [e.type for e in before], (text, swapped)
    assert gaps(swapped, after) == gaps(text, before), (text, swapped)
    assert all(a.value != b.value for a, b in zip(before, after)), (text, swapped)
    return before, after


@pytest.mark.parametrize("text", SMS)
def test_swap_keeps_types_order_and_surrounding_text_and_changes_every_entity(text):
    for seed in range(20):
        assert_swap_keeps_shape(text, seed)


def test_swap_is_deterministic_in_text_and_seed():
    for text in SMS:
        assert swap_entities(text, 7) == swap_entities(text, 7)
    differ = sum(swap_entities(text, 1) != swap_entities(text, 2) for text in SMS)
    assert differ == len(SMS)


def test_swap_without_entities_is_none():
    assert swap_entities("", 0) is None
    assert swap_entities("Ok lar... Joking wif u oni... KL341 4U", 0) is None


@pytest.mark.parametrize("value, shape", [
    ("09061701461", r"0[1-9]\d{9}"),
    ("0800 542 0825", r"0[1-9]\d\d \d{3} \d{4}"),
    ("+44 7700 900123", r"\+44 \d{4} \d{6}"),
    ("+447700900123", r"\+44\d{10}"),
    ("+44 (0)20 7946 0958", r"\+44 \(0\)\d\d \d{4} \d{4}"),
    ("(0800) 542-0825", r"\(0[1-9]\d\d\) \d{3}-\d{4}"),
    ("£1000", r"£[1-9]\d00"),
    ("£1.50", r"£[1-9]\.\d0"),
    ("£1,500.00", r"£[1-9],\d00\.00"),
    ("150p", r"[1-9]\d0p"),
    ("20 pounds", r"[1-9]\d pounds"),
    ("www.getzed.co.uk", r"www\.[a-z]+\.co\.uk"),
    ("http://tinyurl.com/xyz", r"http://[a-z]+\.com/xyz"),
    ("info@bank.co.uk", r"[a-z]+@[a-z]+\.co\.uk"),
    ("12/05/2024", r"(1\d|2\d|3[01])/(0[1-9]|1[0-2])/2024"),
    ("2024-03-12", r"2024-(0[1-9]|1[0-2])-(1\d|2\d|3[01])"),
    ("3rd March", r"[1-9](st|nd|rd|th) (January|February|March|April|June|July|August|September|October|November"
                  r"|December)"),
    ("MAR 3, 2024", r"(JAN|FEB|MAR|APR|JUN|JUL|AUG|SEP|OCT|NOV|DEC) [1-9], 2024"),
    ("1,000", r"[1-9],\d{3}"),
    ("0.5", r"0\.\d"),
])
def test_a_swapped_entity_keeps_its_shape(value, shape):
    for seed in range(10):
        swapped = swap_entities(f"see {value} now", seed)
        new = swapped[len("see "):-len(" now")]
        assert new != value
        assert re.fullmatch(shape, new), (value, new)


def test_a_swapped_date_is_a_valid_date():
    for seed in range(50):
        day, month, year = swap_entities("by 29/02/2024", seed)[3:].split("/")
        datetime.date(int(year), int(month), int(day))
        entity = find_entities(swap_entities("on 3rd March", seed))[0]
        assert normalize(entity) != "--03-03"
        _, m, d = normalize(entity).split("-")[-3:]
        datetime.date(2023, int(m), int(d))


def test_swap_of_the_pathological_inputs_keeps_shape():
    for text in ("1 " * 2000, "0" * 3000, "www." * 500 + "com", "a." * 2000):
        if find_entities(text):
            assert_swap_keeps_shape(text, 3)
        else:
            assert swap_entities(text, 3) is None


def test_swap_keeps_shape_on_random_sms_fragments():
    """Fragments glued in random orders: entities touching each other must keep their types after a swap."""
    fragments = ["Call ", "CALL", "09061701461", "0800 542 0825", "+44 7700 900123", "+44 (0)20 7946 0958",
                 "£1000", "£1.50/wk", "$500", "150p", "1,000", "www.getzed.co.uk", "http://tinyurl.com/xyz",
                 "txt WIN to 87121", "KL341", "12/05/2024", "3rd March", "March 3, 2024", "2024-03-12",
                 "info@bank.co.uk", "bank.com/path", "4U", "2day", " ", " ", ".", ",", "-", "/", "(", ")", "+", "@",
                 "0", "12", "May", "may", " pounds", "p", "www.", ".co.uk", "\n", "now."]
    rng = random.Random(11)
    for k in range(400):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(1, 10)))
        if find_entities(text):
            assert_swap_keeps_shape(text, k)


# ---------------------------------------------------------------- comparing


def one(text):
    entities = find_entities(text)
    assert len(entities) == 1, entities
    return normalize(entities[0])


@pytest.mark.parametrize("a, b", [
    ("£1,000.00", "GBP 1000"),
    ("£1.50", "150p"),
    ("$500", "500 dollars"),
    ("€20", "20 EUR"),
    ("+44 7700 900123", "+447700900123"),
    ("+44 7700 900123", "07700 900123"),
    ("0800 542 0825", "08005420825"),
    ("WWW.Bank.com/", "bank.com"),
    ("http://www.getzed.co.uk", "getzed.co.uk"),
    ("Info@Bank.co.uk", "info@bank.co.uk"),
    ("12/05/2024", "12 May 2024"),
    ("2024-03-03", "March 3rd, 2024"),
    ("1,000", "1000"),
])
def test_normalize_equates_ways_of_writing_the_same_value(a, b):
    assert one(a) == one(b)


@pytest.mark.parametrize("a, b", [("£1000", "$1000"), ("£1000", "£100"), ("0800 542 0825", "0800 542 0826"),
                                  ("bank.com", "bank.co.uk"), ("12/05/2024", "12/06/2024")])
def test_normalize_keeps_different_values_apart(a, b):
    assert one(a) != one(b)


def test_normalize_never_raises_on_an_entity_made_by_hand():
    for kind in ENTITY_TYPES + ("other",):
        for value in ("", "x", "£", "1" * 5000 + "p", "99/99/9999", "+", "١٢٣"):
            assert isinstance(normalize(Entity(kind, value, 0, len(value))), str)


def test_a_response_repeating_the_input_in_another_format_is_supported():
    source = "URGENT! Call +44 7700 900123 to claim £1,000 by 12/05/2024 at www.getzed.co.uk"
    response = "The message asks you to ring 07700 900123 about GBP 1000 by 12 May, via getzed.co.uk."
    assert unsupported_entities(response, [source]) == []


def test_an_invented_value_is_reported():
    source = "URGENT! Call 09061701461 to claim £1000"
    response = "It promises £5000 if you call 09061701461 or 0800 542 0825."
    assert [(e.type, e.value) for e in unsupported_entities(response, [source])] == [
        ("amount", "£5000"), ("phone", "0800 542 0825")]


def test_support_comes_from_any_source_and_from_verbatim_text():
    response = "Call 87121 for £1000"
    assert unsupported_entities(response, ["txt WIN to 87121", "a £1000 prize"]) == []
    assert unsupported_entities(response, "txt WIN to 87121, a £1000 prize") == []  # one string, not characters
    assert [e.value for e in unsupported_entities(response, [])] == ["87121", "£1000"]


# ---------------------------------------------------------------- robustness


@pytest.mark.parametrize("text", ["0" * 100_000, "1 " * 50_000, "a." * 50_000, "www." * 20_000],
                         ids=["zeros", "ones", "a-dots", "www"])
def test_pathological_inputs_finish(text, best_of):
    # A pattern that backtracks takes minutes here. In linear time, four times the input takes about four times as
    # long (a quadratic pattern: sixteen), whatever the input holds.
    quarter = text[: len(text) // 4]
    assert best_of(lambda: find_entities(text), 2) < 8 * best_of(lambda: find_entities(quarter), 2)


def test_a_megabyte_message_is_handled():
    chatter = "Ok lar... Joking wif u oni... " * 17_000
    text = chatter + SMS[3] + " " + chatter
    assert len(text) > 1_000_000
    assert [e.value for e in find_entities(text)] == [e.value for e in find_entities(SMS[3])]
    swapped = swap_entities(text, 0)
    assert swapped.startswith(chatter) and swapped.endswith(chatter) and swapped != text


def test_random_strings_never_raise():
    rng = random.Random(0)
    alphabet = "0123456789+()- ./,:;@£$€%_pPwWmMaAyYkKxX\n\t\x00\x1b\u200b١٢٣é\ud800"
    for k in range(1000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        entities = find_entities(text)
        for e in entities:
            normalize(e)
        swapped = swap_entities(text, k)
        assert (swapped is None) == (not entities)
        unsupported_entities(text, [swapped or ""])
