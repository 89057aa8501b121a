"""Generation metrics: field exact match, token F1, the contract rate, and values supported by the input.
Pure: parsed answers and references in, numbers out."""

import pytest

from rewards.generation_metrics import example_scores, generation_metrics, normalize, supported, token_f1
from templates.contract import OutputContract, Parsed

SCHEMA = {"type": "object", "required": ["merchant", "amount", "channel"],
          "properties": {"merchant": {"type": "string"}, "amount": {"type": "number"},
                         "channel": {"enum": ["card", "transfer", "cash"]}}}
CONTRACT = OutputContract("json", schema=SCHEMA)
REFERENCE = {"merchant": "Acme Bank", "amount": 1250, "channel": "card"}


def test_field_exact_match_counts_each_reference_field_after_normalising():
    answer = CONTRACT.parse('{"merchant": " acme  BANK.", "amount": 1250.0, "channel": "transfer"}')
    assert answer.ok
    exact, f1 = example_scores(answer, REFERENCE)
    assert exact == pytest.approx(2 / 3)  # merchant and amount match, channel does not
    assert f1 == pytest.approx(2 / 3)
    assert normalize(["b", "A"]) == normalize(["a", "b"]) and normalize(1) == normalize(1.0) and normalize(True) is True


def test_token_f1_gives_partial_credit_and_broken_answers_score_nothing():
    assert token_f1("Acme Bank Ltd", "Acme Bank") == pytest.approx(0.8)
    assert token_f1(None, None) == 1.0 and token_f1("x", None) == 0.0
    broken = CONTRACT.parse('{"merchant": "Acme Bank", "amount": 1250')  # cut off
    assert not broken.ok and example_scores(broken, REFERENCE) == (0.0, 0.0)
    metrics = generation_metrics([CONTRACT.parse('{"merchant": "Acme Bank", "amount": 1250, "channel": "card"}'),
                                  broken], [REFERENCE, REFERENCE])
    assert metrics == {"field_exact_match": 0.5, "token_f1": 0.5, "contract_rate": 0.5}
    with pytest.raises(ValueError, match="2 answers for 1 references"):
        generation_metrics([broken, broken], [REFERENCE])


def test_a_regex_or_scalar_reference_is_matched_whole():
    regex = OutputContract("regex", pattern=r"\+?\d[\d ]{6,}")
    assert example_scores(regex.parse("+44 7700 900123"), "+44 7700 900123") == (1.0, 1.0)
    assert example_scores(regex.parse("+44 7700 900999"), "+44 7700 900123")[0] == 0.0


def test_supported_values_must_appear_in_the_input_and_enums_are_exempt():
    text = "Payment of EUR 1,250 to ACME   Bank by card on 3 May"
    good = CONTRACT.parse('{"merchant": "acme bank", "amount": 1250, "channel": "transfer"}')
    assert supported(good, text, SCHEMA)  # "transfer" is an enum value: a judgement, not an entity
    invented = CONTRACT.parse('{"merchant": "Acme Bank", "amount": 9999, "channel": "card"}')
    assert not supported(invented, text, SCHEMA)
    assert not supported(CONTRACT.parse('{"merchant": "Globex", "amount": 1250, "channel": "card"}'), text, SCHEMA)
    assert not supported(Parsed(False, None, "not JSON"), text, SCHEMA)
    nested = OutputContract("json", schema={"type": "array", "items": {"type": "string"}})
    assert supported(nested.parse('["bank", "card"]'), text, nested.schema)
    assert not supported(nested.parse('["bank", "crypto"]'), text, nested.schema)
