"""Templates: strict parsing, literal rendering, constraints, and hostile text from a model."""


import pytest

from templates.template import Constraint, Template, TemplateError, constraints_from_spec, validate_candidate

SEED = "Read the SMS message below.\nMessage: {text}\nIs this message a scam? Answer yes or no."


def test_render_fills_the_placeholder_literally():
    t = Template(SEED, ("text",))
    out = t.render({"text": "Win {prize} now {{x}} {text.__class__}"})
    assert out == SEED.replace("{text}", "Win {prize} now {{x}} {text.__class__}")


def test_escaped_braces_are_literal():
    t = Template('Reply as JSON {{"label": ...}} for {text}', ("text",))
    assert t.render(text="hi") == 'Reply as JSON {"label": ...} for hi'


@pytest.mark.parametrize(
    "text",
    [
        "{text.__class__}",
        "Message: {0.__init__.__globals__}",
        "{text} {0}",
        "{text:{width}}",
        "{text!r}",
        "{text[0]}",
        "{{ ''.__class__ }} {text} {% for x in y %}",
        "{ text }",
        "{text",
        "text}",
        "{__import__('os').system('echo pwned')} {text}",
    ],
)
def test_hostile_template_text_is_rejected(text):
    check = validate_candidate(text, ("text",), max_tokens=1000)
    assert not check.ok, text
    assert check.reasons and check.template is None
    with pytest.raises(TemplateError):
        Template(text, ("text",))


def test_jinja_expression_alone_renders_literally():
    t = Template("{{ ''.__class__.__mro__ }} {text}", ("text",))
    assert t.render(text="x") == "{ ''.__class__.__mro__ } x"


def test_missing_and_repeated_placeholders_are_rejected():
    assert "lacks" in validate_candidate("no placeholder here", ("text",), 100).reasons[0]
    assert "more than once" in validate_candidate("{text} and {text}", ("text",), 100).reasons[0]
    assert "undeclared" in validate_candidate("{text} {label}", ("text",), 100).reasons[0]


def test_a_megabyte_template_is_rejected_quickly():
    big = "A" * 1_000_000 + " {text}"
    counted = []
    check = validate_candidate(big, ("text",), max_tokens=10_000, count_tokens=lambda s: counted.append(s) or 1)
    assert not check.ok and "limit" in check.reasons[0]
    assert counted == []  # rejected by size before any tokenization


def test_token_budget():
    check = validate_candidate("one two three {text}", ("text",), max_tokens=3, count_tokens=lambda s: len(s.split()))
    assert not check.ok and "over the budget" in check.reasons[0]
    assert validate_candidate("one {text}", ("text",), 3, lambda s: len(s.split())).ok


def test_render_missing_and_unknown_variables():
    t = Template("{a} and {b}", ("a", "b"))
    with pytest.raises(TemplateError, match="missing variable"):
        t.render(a="1")
    with pytest.raises(TemplateError, match="unknown variable"):
        t.render(a="1", b="2", c="3")
    with pytest.raises(TemplateError, match="must be a string"):
        t.render(a="1", b=object())


def test_constraints_category_in_and_regex():
    t = Template(
        "{category}: {text}",
        ("category", "text"),
        tuple(constraints_from_spec({"category": {"in": ["sms", "transaction"]}, "text": {"regex": r"[^\x00]{1,50}"}})),
    )
    assert t.render(category="sms", text="hello") == "sms: hello"
    with pytest.raises(TemplateError, match="not one of"):
        t.render(category="email", text="hello")
    with pytest.raises(TemplateError, match="does not match"):
        t.render(category="sms", text="x" * 51)


def test_bad_constraint_specs():
    with pytest.raises(TemplateError, match="unknown operator"):
        Constraint("text", "eval", "1+1")
    with pytest.raises(TemplateError, match="bad regular expression"):
        Constraint("text", "regex", "(")
    with pytest.raises(TemplateError, match="not a declared variable"):
        Template("{text}", ("text",), (Constraint("other", "max_chars", 3),))


def test_regex_constraint_runs_in_linear_time(best_of):
    # Python's re backtracks about 2**26 times on the first (seconds; each extra "a" doubles it); RE2 never backtracks.
    t = Template("{text}", ("text",), (Constraint("text", "regex", "(a+)+$"),))
    plain = Template("{text}", ("text",), (Constraint("text", "regex", "a+$"),))  # nothing to backtrack into

    def refused(template, length):
        with pytest.raises(TemplateError, match="does not match"):
            template.render(text="a" * length + "b")

    for length in (26, 100_000):
        assert best_of(lambda: refused(t, length)) < 20 * best_of(lambda: refused(plain, length))
    assert t.render(text="aaaa") == "aaaa"


@pytest.mark.parametrize("pattern, feature", [(r"(a)\1", r"\\1"), ("(?=a)a", r"\(\?="), ("(?<!x)y", r"\(\?<!"),
                                              ("a{1001}", "repetition"), ("\ud800", "surrogate")])
def test_regex_features_re2_lacks_are_refused_by_name(pattern, feature):
    with pytest.raises(TemplateError, match=f"bad regular expression.*{feature}.*RE2 syntax"):
        Constraint("text", "regex", pattern)


def test_regex_constraint_on_a_value_with_a_lone_surrogate():
    # JSON data can carry "\ud800"; RE2 sees it as U+FFFD instead of failing to encode it.
    assert Constraint("text", "regex", ".*").violation("x\ud800y") is None
    assert "does not match" in Constraint("text", "regex", "[a-z]*").violation("x\ud800y")


def test_a_record_whose_variables_are_not_a_list_is_refused():
    with pytest.raises(TemplateError, match="'variables' must be a list"):
        Template.from_dict({"text": "", "variables": False})


def test_round_trip_through_dict():
    t = Template("{category}: {text}", ("category", "text"), (Constraint("category", "in", ["a", "b"]),))
    again = Template.from_dict(t.to_dict())
    assert again == t and again.render(category="a", text="x") == "a: x"
    with pytest.raises(TemplateError, match="unknown field"):
        Template.from_dict({"text": "{x}", "code": "rm -rf /"})
