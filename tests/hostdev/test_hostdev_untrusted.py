from __future__ import annotations

import ast
import io
import logging

import pytest

from hostdev.untrusted import quote_untrusted


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("nvidia.com/GA102", "'nvidia.com/GA102'"),
        ("", "''"),
        ("a\nINFO forged line", "'a\\nINFO forged line'"),
        ("cr\rtab\t", "'cr\\rtab\\t'"),
        ("it's", "'it\\'s'"),
        ("back\\slash", "'back\\\\slash'"),
        ("nul\x00esc\x1b[31m", "'nul\\x00esc\\x1b[31m'"),
        ("del\x7f", "'del\\x7f'"),
        ("bidi\u202egnp.exe", "'bidi\\u202egnp.exe'"),
        ("line\u2028sep", "'line\\u2028sep'"),
        ("lone\ud800surrogate", "'lone\\ud800surrogate'"),
        ("tag\U000e0041", "'tag\\U000e0041'"),
        ("caf\u00e9 \u8bbe\u5907", "'caf\u00e9 \u8bbe\u5907'"),
    ],
    ids=[
        "plain",
        "empty",
        "newline",
        "cr-tab",
        "quote",
        "backslash",
        "c0-controls",
        "del",
        "bidi-override",
        "line-separator",
        "lone-surrogate",
        "astral-format-char",
        "printable-unicode-kept",
    ],
)
def test_escapes_what_could_break_a_line_or_a_reader(text: str, expected: str) -> None:
    assert quote_untrusted(text) == expected


@pytest.mark.parametrize(
    "text",
    ["plain", "a\nb", 'it\'s "both"', "\\n literal", "\x00\x1f\x7f\x80\x9f", "\u202e\ud800", "é"],
)
def test_reads_back_as_the_original_when_not_cut(text: str) -> None:
    assert ast.literal_eval(quote_untrusted(text)) == text


def test_a_long_text_is_cut_and_says_how_much_was_dropped() -> None:
    quoted = quote_untrusted("x" * 1_000_000, limit=10)
    assert quoted == "'xxxxxxxxxx'...[+999990 chars]"


def test_the_cut_never_splits_an_escape() -> None:
    quoted = quote_untrusted("ab\n\n\n", limit=5)
    assert quoted == "'ab\\n'...[+2 chars]"


def test_exactly_the_limit_is_not_cut() -> None:
    assert quote_untrusted("abcde", limit=5) == "'abcde'"
    assert quote_untrusted("abcdef", limit=5) == "'abcde'...[+1 chars]"


def test_escapes_count_against_the_limit() -> None:
    quoted = quote_untrusted("\U0010ffff" * 100, limit=25)
    assert quoted == "'" + "\\U0010ffff" * 2 + "'...[+98 chars]"


@pytest.mark.parametrize(
    "text",
    ["\n" * 10_000, "\U000e0041" * 10_000, "x" * 10_000, "é\u202e" * 5_000],
    ids=["newlines", "astral", "ascii", "mixed"],
)
def test_result_is_one_short_printable_line_whatever_the_input(text: str) -> None:
    quoted = quote_untrusted(text, limit=200)
    assert quoted.isprintable()
    assert len(quoted) <= 230
    quoted.encode("utf-8")


def test_a_log_record_with_hostile_text_stays_one_line() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log = logging.getLogger("test_hostdev_untrusted")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("refused %s", quote_untrusted("x\nCRITICAL admitted everything\ud800"))
    finally:
        log.removeHandler(handler)
    assert stream.getvalue().count("\n") == 1
    stream.getvalue().encode("utf-8")


def test_a_negative_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="limit must be 0 or more"):
        quote_untrusted("x", limit=-1)
