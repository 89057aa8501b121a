"""Entities in a message (URLs, emails, phone numbers, amounts, dates, numbers), for ``entity_consistency``.

``entity_consistency`` is a rate over the target's responses, with one rule per kind of task:

* classification: the decision must not change when the input's entities are replaced by others of the same
  type (one phone number for another, one amount for another). The scorer asks ``swap_entities(text, seed)``
  for the counterfactual input and compares the two decisions; an input without entities is left out.
* generation: every entity value in a response must be supported by the input or the reference;
  ``unsupported_entities(response, sources)`` lists the ones that are not.

The types, earlier ones winning where two overlap: ``url``, ``email``, ``phone``, ``amount``, ``date``,
``number``. The patterns are heuristics for the risk team's data, UK SMS (the SMS Spam Collection): premium
and freephone numbers, 5-digit shortcodes after "txt WIN to", pounds and pence, bare domains such as
getzed.co.uk. Alphanumeric codes ("KL341", "4U", "2day") are not entities.

Whether something is an entity depends only on its shape (digit counts, separators, a leading 0 or +, the
characters around it), and each type is looked for with the entities of earlier types blanked out. A swap
keeps the shape, so the swapped text has the same entity types in the same order. Every pattern runs in
linear time: it starts only where a token starts, takes the whole candidate with possessive quantifiers and
leaves the checks to Python, so each pattern passes over the text once.

The module is long because the patterns, their shape checks and the swap that must keep every shape are one
design; each type's pattern sits next to the checks that make it linear.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

ENTITY_TYPES = ("url", "email", "phone", "amount", "date", "number")


@dataclass(frozen=True)
class Entity:
    type: str  # one of ENTITY_TYPES
    value: str  # the text as it appears
    start: int
    end: int


# ---------------------------------------------------------------- patterns

# A bare domain needs one of these endings; "www." or a scheme makes any host a URL. ly, mobi: bit.ly and the
# .mobi sites of UK text spam.
_TLDS = frozenset("com net org uk info biz io me tv us eu de ly mobi".split())
_SUFFIXES2 = frozenset({"co.uk", "org.uk", "ac.uk", "gov.uk", "me.uk", "ltd.uk", "plc.uk"})
_URL_END_PUNCT = ".,;:!?)]}'\""

# Every alternative starts where a token starts (the lookbehind), so a candidate is tried once.
_URL = re.compile(
    r"(?<![A-Za-z0-9_@%+.-])"
    r"(?:(?P<scheme>https?://)(?P<shost>[A-Za-z0-9-]++(?:\.[A-Za-z0-9-]++)*+)"
    r"|(?P<host>[A-Za-z0-9-]++(?:\.[A-Za-z0-9-]++)++))"
    r"(?::\d{1,5}+)?"
    r"(?:[/?#][^\s<>\"']*+)?",
    re.I | re.A,
)
_EMAIL = re.compile(r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]++@[A-Za-z0-9-]++(?:\.[A-Za-z0-9-]++)++", re.A)

# A run of digit groups separated by one space or dash; _phones cuts phone numbers out of it.
_DIGIT_RUN = re.compile(r"(?<![0-9+/_£$€])(?<![0-9][.,])\+?[(\d][\d()]*+(?:[ -][(\d][\d()]*+)*+", re.A)
_GROUP = re.compile(r"\+?[\d()]++", re.A)
_SHORTCODE = re.compile(
    r"(?<![A-Za-z0-9_])(?i:to|text|txt|call|send|ring|reply|sms) {1,2}(\d{5})(?![A-Za-z0-9_])(?![.,]\d)", re.A
)

_NUM = r"\d++(?:[.,]\d++)*+"
_AMOUNT = re.compile(
    rf"(?:[£$€]|(?<![A-Za-z])(?i:gbp|usd|eur)) ?{_NUM}"
    rf"|(?<![\w£$€])(?<![0-9][.,]){_NUM}"
    r"(?:(?i:p)|(?: ?(?i:pence|pounds?|quid|dollars?|euros?|gbp|usd|eur)))(?![A-Za-z0-9_])",
    re.A,
)

_MONTHS = ("january", "february", "march", "april", "may", "june", "july", "august", "september", "october",
           "november", "december")
_MONTH = r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?|sep(?:t(?:ember)?)?" \
         r"|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)"
_ORDINAL = r"(?:st|nd|rd|th)"
# Numeric dates count by shape ("99/99/9999" is a date) so that swapping a number can never make or unmake one.
_DATE = re.compile(
    r"(?<![\w./-])(?:"
    r"(?P<y1>\d{4})(?P<s1>[/.-])(?P<m1>\d{1,2})(?P=s1)(?P<d1>\d{1,2})"
    r"|(?P<d2>\d{1,2})(?P<s2>[/.-])(?P<m2>\d{1,2})(?P=s2)(?P<y2>\d{4}|\d{2})"
    rf"|(?P<d3>\d{{1,2}})(?P<o3>{_ORDINAL})?(?: (?:of )?|-)(?P<w3>{_MONTH})(?:(?:,? |-)(?P<y3>\d{{4}}|(?<=-)\d{{2}}))?"
    rf"|(?P<w4>{_MONTH})\.? (?P<d4>\d{{1,2}})(?P<o4>{_ORDINAL})?(?:,? (?P<y4>\d{{4}}))?"
    r")(?![\w]|[./-]\d)",
    re.I | re.A,
)

_NUMBER = re.compile(rf"(?<![\w])(?<![0-9][.,]){_NUM}(?![\w])", re.A)

_CURRENCY = {"£": "GBP", "gbp": "GBP", "pound": "GBP", "pounds": "GBP", "quid": "GBP", "p": "GBP", "pence": "GBP",
             "$": "USD", "usd": "USD", "dollar": "USD", "dollars": "USD",
             "€": "EUR", "eur": "EUR", "euro": "EUR", "euros": "EUR"}

_HOST_WORDS = ("fastprize", "quickwin", "lendfast", "cashnow", "mybonus", "prizeclaim", "safepay", "rewardhub",
               "luckydraw", "easyloan", "topdeals", "winzone", "getcash", "claimnow", "bestoffer", "moneyhub")
_MAILBOX_WORDS = ("info", "support", "claims", "help", "admin", "offers", "service", "team", "contact", "billing")


# ---------------------------------------------------------------- finding


def find_entities(text: str) -> list[Entity]:
    """Non-overlapping entities in reading order. Earlier types in ENTITY_TYPES win overlaps (a URL's digits are
    not also a number; a phone number's digits are not a number; "£1,500.00" is one amount, not numbers)."""
    if not isinstance(text, str) or not text:
        return []
    entities: list[Entity] = []
    seen = text
    for kind, find in (("url", _urls), ("email", _emails), ("phone", _phones), ("phone", _shortcodes),
                       ("amount", _amounts), ("date", _dates), ("number", _numbers)):
        found = [Entity(kind, text[start:end], start, end) for start, end in find(seen)]
        if found:
            entities = sorted(entities + found, key=lambda e: e.start)
            seen = _masked(seen, found)
    return entities


def _masked(text: str, found: Sequence[Entity]) -> str:
    """``text`` with the entities found so far blanked out by NULs, which no later pattern matches. Later types
    then see the same text whatever a found entity holds, so swapping one cannot change what else is found."""
    out, last = [], 0
    for e in found:
        out += [text[last:e.start], "\0" * (e.end - e.start)]
        last = e.end
    out.append(text[last:])
    return "".join(out)


def _amounts(text: str) -> Iterator[tuple[int, int]]:
    return (m.span() for m in _AMOUNT.finditer(text))


def _numbers(text: str) -> Iterator[tuple[int, int]]:
    return (m.span() for m in _NUMBER.finditer(text))


def _suffix_labels(labels: list[str]) -> int:
    """How many of the (lower-case) ``labels`` form a known public suffix: 2 for co.uk, 1 for com, 0 if unknown."""
    if len(labels) >= 2 and ".".join(labels[-2:]) in _SUFFIXES2:
        return 2
    return 1 if labels[-1] in _TLDS else 0


def _bare_host_ok(host: str) -> bool:
    labels = host.lower().split(".")
    if labels[0] == "www" and len(labels) >= 3 and labels[-1].isalpha() and len(labels[-1]) >= 2:
        return True
    n = _suffix_labels(labels)
    return n > 0 and len(labels) > n and any(c.isalpha() for c in labels[-n - 1])


def _urls(text: str) -> Iterator[tuple[int, int]]:
    for m in _URL.finditer(text):
        start = m.start()
        host = m.group("host")
        if host is not None:
            if text.startswith("@", m.end("host")):  # the local part of an email ("john.me@bank.com")
                continue
            cut = host.lower().find(".www.")  # "now.www.getzed.co.uk": a sentence run into the address
            if cut >= 0 and not host.lower().startswith("www."):
                start, host = start + cut + 1, host[cut + 1:]
            if not _bare_host_ok(host):
                continue
        yield start, m.start() + len(m.group(0).rstrip(_URL_END_PUNCT))


def _emails(text: str) -> Iterator[tuple[int, int]]:
    for m in _EMAIL.finditer(text):
        tld = m.group(0).rsplit(".", 1)[1]
        if tld.isalpha() and len(tld) >= 2:
            yield m.span()


def _dates(text: str) -> Iterator[tuple[int, int]]:
    for m in _DATE.finditer(text):
        word = m.group("w3") or m.group("w4") or ""
        if word.lower() == "may" and not word[0].isupper():  # "i may 2 go": a lower-case "may" is the verb
            continue
        yield m.span()


def _shortcodes(text: str) -> Iterator[tuple[int, int]]:
    for m in _SHORTCODE.finditer(text):
        yield m.span(1)


@dataclass
class _Group:
    start: int
    end: int
    digits: int
    plus: bool  # "+44"
    zero: bool  # its first digit is 0
    trunk: bool  # "(0)": one digit in brackets, as in "+44 (0)20 ..."
    blocked: bool  # no digits, inside a date, or the start of a decimal ("1.50")
    glued: bool  # touches a word ("CALL09061701461", "08452810075over18's", "2day")


def _phones(text: str) -> Iterator[tuple[int, int]]:
    """Phone numbers cut from runs of digit groups: 7-15 digits starting with + or 0 (groups join until the
    number is complete: 10 digits, 11 after a +), or one group of 10-13 digits. Shape only, never digit values
    beyond a leading 0, so a swapped number is found again."""
    dates = list(_dates(text))  # a date's digits are never part of a phone number: "01-02-2024"
    d = 0
    for run in _DIGIT_RUN.finditer(text):
        groups: list[_Group] = []
        for g in _GROUP.finditer(text, run.start(), run.end()):
            raw = g.group(0)
            digits = sum(c.isdigit() for c in raw)
            while d < len(dates) and dates[d][1] <= g.start():
                d += 1
            in_date = d < len(dates) and dates[d][0] < g.end()
            after = text[g.end():g.end() + 2]
            groups.append(_Group(
                g.start(), g.end(), digits, raw[0] == "+", raw.lstrip("+(")[:1] == "0",
                raw.startswith("(") and raw.endswith(")") and digits == 1 and len(raw) == 3,
                digits == 0 or in_date or after[:1] == "_" or (after[:1] in (".", ",") and after[1:].isdigit()),
                (g.start() > 0 and text[g.start() - 1].isalpha()) or after[:1].isalpha(),
            ))
        i = 0
        while i < len(groups):
            g = groups[i]
            single_run = not g.plus and text[g.start:g.end].isdigit()
            if g.blocked or g.glued or not (g.plus or g.zero):
                # One group of 10-13 digits; touching a word, only a UK number (0...) counts.
                if not g.blocked and single_run and 10 <= g.digits <= 13 and (g.zero or not g.glued):
                    yield g.start, g.end
                i += 1
                continue
            total, j = g.digits, i
            complete = 11 if g.plus else 10
            while total < complete and j + 1 < len(groups):
                h = groups[j + 1]
                if h.blocked or h.plus or total + h.digits > 15 or (h.digits < 2 and not h.trunk):
                    break
                total, j = total + h.digits, j + 1
            if 7 <= total <= 15:
                yield _trim_brackets(text, g.start, groups[j].end)
                i = j + 1
            else:
                i += 1


def _trim_brackets(text: str, start: int, end: int) -> tuple[int, int]:
    """Leave out a bracket that belongs to the sentence: "(call 0800 542 0825)"."""
    value = text[start:end]
    if value.endswith(")") and value.count(")") > value.count("("):
        end -= 1
    elif value.startswith("(") and value.count("(") > value.count(")"):
        start += 1
    return start, end


# ---------------------------------------------------------------- swapping


def swap_entities(text: str, seed: int) -> str | None:
    """The text with every entity replaced by a different value of the same type and shape, deterministic in
    (text, seed); None when the text has no entity."""
    entities = find_entities(text)
    if not entities:
        return None
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    rng = random.Random(int(seed) ^ int.from_bytes(digest[:8], "big"))
    swap = {"url": _swap_url, "email": _swap_email, "phone": _swap_phone, "amount": _swap_amount,
            "date": _swap_date, "number": _swap_number}
    out, last = [], 0
    for e in entities:
        out += [text[last:e.start], swap[e.type](e.value, rng)]
        last = e.end
    out.append(text[last:])
    return "".join(out)


def _new_digits(value: str, rng: random.Random, keep: Iterable[int] = (), nonzero: Iterable[int] = ()) -> str:
    """``value`` with its digits redrawn, except at the positions in ``keep``; positions in ``nonzero`` draw
    1-9. The result differs from ``value`` whenever some digit may change."""
    keep, nonzero = set(keep), set(nonzero)
    free = [i for i, c in enumerate(value) if "0" <= c <= "9" and i not in keep]
    if not free:
        return value
    chars = list(value)
    for i in free:
        chars[i] = rng.choice("123456789" if i in nonzero else "0123456789")
    if chars == list(value):  # drew the same digits: move the last free one on by one
        i = free[-1]
        low = 1 if i in nonzero else 0
        chars[i] = str(low + (int(value[i]) - low + 1) % (10 - low))
    return "".join(chars)


def _digit_positions(value: str) -> list[int]:
    return [i for i, c in enumerate(value) if "0" <= c <= "9"]


def _swap_phone(value: str, rng: random.Random) -> str:
    """Same spacing and brackets; keeps the leading digit (a 0 stays a 0), a + country code and a "(0)"."""
    positions = _digit_positions(value)
    if value.startswith("+"):
        code = len(re.match(r"\+(\d*)", value).group(1))
        keep = positions[:code if code <= 3 else (1 if value[1] in "17" else 2)]
    else:
        keep = positions[:1]
    keep += [m.start(1) for m in re.finditer(r"\((\d)\)", value)]
    # After a leading 0 comes an area code, never a second 0 (00 is the international prefix).
    nonzero = positions[1:2] if value[positions[0]] == "0" and not value.startswith("+") else []
    return _new_digits(value, rng, keep, nonzero)


def _swap_number(value: str, rng: random.Random) -> str:
    """Same digit count and separators; a leading 0 stays 0 (so "0800" cannot turn into a phone number)."""
    positions = _digit_positions(value)
    if value[positions[0]] == "0" and len(positions) > 1:
        return _new_digits(value, rng, keep=positions[:1])
    return _new_digits(value, rng, nonzero=positions[:1])


def _swap_amount(value: str, rng: random.Random) -> str:
    """Same currency and format; the first two significant digits change, later zeros stay (£1000 -> £3700)."""
    positions = _digit_positions(value)
    lead_zero = value[positions[0]] == "0"
    significant = positions[1:] if lead_zero else positions
    free = significant[:2] + [i for i in significant[2:] if value[i] != "0"]
    if not free:  # "£0"
        return _new_digits(value, rng, nonzero=positions[:1])
    keep = [i for i in positions if i not in set(free)]
    return _new_digits(value, rng, keep, nonzero=[] if lead_zero else positions[:1])


def _styled(word: str, like: str) -> str:
    if like.isupper():
        return word.upper()
    return word.capitalize() if like[:1].isupper() else word


def _other_word(words: Sequence[str], like: str, rng: random.Random) -> str:
    return _styled(rng.choice([w for w in words if w != like.lower()]), like)


def _swap_host(host: str, rng: random.Random) -> str:
    """The host with the label before its public suffix (getzed in www.getzed.co.uk) replaced by another word."""
    labels = host.split(".")
    i = max(0, len(labels) - max(1, _suffix_labels([x.lower() for x in labels])) - 1)
    if labels[i].isdigit():  # an IP address after a scheme
        labels[i] = _new_digits(labels[i], rng)
    else:
        labels[i] = _other_word(_HOST_WORDS, labels[i], rng)
    return ".".join(labels)


def _swap_url(value: str, rng: random.Random) -> str:
    """Same scheme, "www.", suffix and path; another host name."""
    m = re.match(r"(https?://)?([A-Za-z0-9.-]*)", value, re.I)
    return (m.group(1) or "") + _swap_host(m.group(2), rng) + value[m.end():]


def _swap_email(value: str, rng: random.Random) -> str:
    """Another mailbox and host name. Punctuation leading the mailbox stays: it is what ends a URL glued before
    the address ("getzed.co.uk+info@bank.co.uk")."""
    local, domain = value.rsplit("@", 1)
    name = local.lstrip("._%+-")
    if name:
        local = local[:len(local) - len(name)] + _other_word(_MAILBOX_WORDS, name, rng)
    return local + "@" + _swap_host(domain, rng)


def _month_number(word: str) -> int:
    return [name[:3] for name in _MONTHS].index(word[:3].lower()) + 1


def _days_in(month: int, year: int) -> int:
    if month == 2:
        return 29 if year % 4 == 0 and (year % 100 != 0 or year % 400 == 0) else 28
    return 30 if month in (4, 6, 9, 11) else 31


def _padded(field: str) -> bool:
    return len(field) > 1 and field[0] == "0"


def _field(original: str, value: int) -> str:
    return str(value).zfill(len(original)) if _padded(original) else str(value)


def _fits(original: str, value: int) -> bool:
    """Whether ``value`` keeps the width of the ``original`` field: "3" takes 1-9, "12" takes 10-31, "05" any."""
    return _padded(original) or len(str(value)) == len(original)


def _ordinal(day: int, like: str) -> str:
    suffix = "th" if 11 <= day % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return suffix.upper() if like.isupper() else suffix


def _swap_date(value: str, rng: random.Random) -> str:
    """Another valid date in the same format: the day and month change, the year and the separators stay."""
    m = _DATE.fullmatch(value)
    if m is None:  # not from find_entities
        return _new_digits(value, rng)
    n = next(k for k in "1234" if m.group("d" + k) is not None)
    day, year = m.group("d" + n), m.group("y" + n)
    month = m.group(("m" if n in "12" else "w") + n)
    numeric = n in "12"
    old = (int(day), int(month) if numeric else _month_number(month))
    year_value = (int(year) if len(year) == 4 else 2000 + int(year)) if year else 2023  # 2023: no 29 February
    # A month word never becomes May: a lower-case "may" is not read as a month.
    months = [x for x in range(1, 13) if (_fits(month, x) if numeric else x != 5)]
    while True:  # at least two months fit, so this ends
        new_month = rng.choice(months)
        new_day = rng.choice([x for x in range(1, _days_in(new_month, year_value) + 1) if _fits(day, x)])
        if numeric:
            new_month_text = _field(month, new_month)
        else:
            name = _MONTHS[new_month - 1]
            new_month_text = _styled(name[:3] if len(month) == 3 or month.lower() == "sept" else name, month)
        if (new_day, new_month) != old:
            break
    parts = {"d" + n: _field(day, new_day), ("m" if numeric else "w") + n: new_month_text}
    if not numeric and m.group("o" + n):
        parts["o" + n] = _ordinal(new_day, m.group("o" + n))
    out, last = [], 0
    for name in sorted(parts, key=m.start):
        out += [value[last:m.start(name)], parts[name]]
        last = m.end(name)
    return "".join(out) + value[last:]


# ---------------------------------------------------------------- comparing


def _plain_number(number: str) -> str:
    """"1,500.00" -> "1500", "1.50" -> "1.5", "20,50" -> "20.5", "1.000.000" -> "1000000". The last separator is
    a decimal point when it occurs once and is a "." or is a "," not followed by exactly three digits."""
    cut = max(number.rfind("."), number.rfind(","))
    if cut < 0:
        return number
    sep, tail = number[cut], number[cut + 1:]
    if number.count(sep) == 1 and (sep == "." or len(tail) != 3):
        whole, fraction = number[:cut], tail.rstrip("0")
    else:
        whole, fraction = number, ""
    whole = whole.replace(",", "").replace(".", "")
    return whole + "." + fraction if fraction else whole


def _date_parts(value: str) -> tuple[int | None, int, int] | None:
    """(year or None, month, day) of a date as written (UK order, US order when only that is valid)."""
    m = _DATE.fullmatch(value)
    if m is None:
        return None
    n = next(k for k in "1234" if m.group("d" + k) is not None)
    day, year = int(m.group("d" + n)), m.group("y" + n)
    if n in "12":
        month = int(m.group("m" + n))
        if n == "2" and month > 12 >= day:
            day, month = month, day
    else:
        month = _month_number(m.group("w" + n))
    if year and len(year) == 2:
        year = ("20" if int(year) < 70 else "19") + year
    if not (1 <= month <= 12 and 1 <= day <= 31):
        return None
    return (int(year) if year else None), month, day


def normalize(entity: Entity) -> str:
    """A comparable form: url/email casefolded without trailing punctuation and scheme 'http(s)://' and 'www.';
    phone: digits only (keep a leading '+' country code digits); amount: currency symbol/code normalised (£, GBP
    -> GBP; $, USD -> USD; €, EUR -> EUR; 'p' pence ok) + the number without thousands separators and with
    trailing '.00' dropped; date: the digits/month words casefolded; number: digits without separators.

    Beyond that: +44 numbers are written as UK national numbers ("+44 (0)20 ..." -> "020 ..."); pence become
    pounds (150p -> GBP 1.5); dates that parse become "YYYY-MM-DD" ("--MM-DD" without a year); numbers keep their
    decimal part without trailing zeros."""
    value = entity.value
    kind = entity.type
    if kind in ("url", "email"):
        out = value.casefold().rstrip(_URL_END_PUNCT + "/")
        out = re.sub(r"^https?://", "", out)
        return out[4:] if out.startswith("www.") else out
    if kind == "phone":
        digits = "".join(c for c in value if "0" <= c <= "9")
        if value.startswith("+44"):
            return "0" + (digits[3:] if re.match(r"\+44[ -]?\(0\)", value) else digits[2:])
        return ("+" if value.startswith("+") else "") + digits
    if kind == "amount":
        m = re.search(r"\d[\d.,]*", value)
        if m is None:
            return value.casefold()
        number = _plain_number(m.group(0).rstrip(".,"))
        mark = (value[:m.start()] + " " + value[m.end():]).strip().casefold()
        currency = _CURRENCY.get(mark, mark.upper())
        if mark in ("p", "pence"):  # to pounds, in text: int() would refuse a 5000-digit number
            whole, _, fraction = number.partition(".")
            whole = whole.zfill(3)
            number = _plain_number(whole[:-2] + "." + whole[-2:] + fraction)
        whole, dot, fraction = number.partition(".")
        return f"{currency} {whole.lstrip('0') or '0'}{dot}{fraction}"
    if kind == "date":
        parts = _date_parts(value)
        if parts is None:
            return " ".join(re.findall(r"[0-9]+|[A-Za-z]+", value)).casefold()
        year, month, day = parts
        return f"{year:04d}-{month:02d}-{day:02d}" if year is not None else f"--{month:02d}-{day:02d}"
    if kind == "number":
        return _plain_number(value)
    return value.casefold()


def unsupported_entities(response: str, sources: Sequence[str]) -> list[Entity]:
    """Entities of ``response`` whose normalized value appears among the normalized entities of none of
    ``sources`` (also accept when the raw value appears verbatim, casefolded, in a source). A dated source also
    supports the same day without its year."""
    if isinstance(sources, str):
        sources = [sources]
    texts = [s for s in sources if isinstance(s, str)]
    known = set()
    for source in texts:
        for e in find_entities(source):
            value = normalize(e)
            known.add(value)
            if e.type == "date" and re.fullmatch(r"\d{4}-\d\d-\d\d", value):
                known.add("-" + value[4:])
    folded = [s.casefold() for s in texts]
    return [e for e in find_entities(response)
            if normalize(e) not in known and not any(e.value.casefold() in f for f in folded)]
