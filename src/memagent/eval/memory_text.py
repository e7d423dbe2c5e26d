"""Text measures of memories used by the diagnostics (:mod:`memagent.eval.diagnostics`): word-bounded
containment of an answer, repeated n-grams, the numbers a text names, the early-guess test, and where the gold value stands among the
document's other values."""

from __future__ import annotations

import re
from collections.abc import Sequence

from memagent.verifiers import normalize_answer, normalize_keep_articles

_WORD = re.compile(r"\w+")
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w]|\.\d)")


def _norm(text: str, keep_articles: bool) -> str:
    return normalize_keep_articles(text) if keep_articles else normalize_answer(text)


def contains(text: str | None, target: str) -> bool:
    """Normalised, word-bounded containment of ``target`` in ``text`` (SQuAD normalisation of both; a target
    made of articles only keeps its articles on both sides, as the verifiers do).

    ``contains("VAR ABCDE = 1", "abcde")`` is True; ``contains("12345678", "1234567")`` is False.

    A target of digits only (RULER's needle values) is matched as a whole number in the raw text: punctuation
    around it is a boundary (``"x:1234567"`` holds it) and does not join digits (``"123-4567"`` and
    ``"12345.67"`` do not), where deleting punctuation first would do both the other way.
    """
    bare = target.strip()
    if bare.isascii() and bare.isdigit():
        return re.search(rf"(?<!\d){bare}(?!\d)", text or "") is not None
    keep = not normalize_answer(target)
    t = _norm(target, keep)
    return bool(t) and f" {t} " in f" {_norm(text or '', keep)} "


def repeated_ngram_share(text: str, n: int = 4) -> float | None:
    """Share of a text's word ``n``-grams that repeat an earlier one: ``1 - distinct / all``.

    Words are maximal runs of letters, digits and ``_``, lower-cased. ``"a b c d a b c d"`` has five 4-grams,
    four distinct: 0.2.

    Returns:
        The share in [0, 1), or ``None`` for a text of fewer than ``n`` words (no n-gram).
    """
    words = _WORD.findall(text.lower())
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else None


def numbers_in_order(text: str | None) -> list[str]:
    """The numbers of :func:`numbers`, in reading order, repeats included."""
    return _NUMBER.findall(text or "")


def numbers(text: str | None) -> set[str]:
    """The numbers written in a text: maximal digit runs not touching a letter, digit or ``_`` (a decimal point
    between digits joins them). ``numbers("is 1, then 5915962. v2 3.5") == {"1", "5915962", "3.5"}``."""
    return set(_NUMBER.findall(text or ""))


def early_guess(answer: str | None, golds: Sequence[str], memories_before: Sequence[str]) -> bool:
    """Whether a wrong answer repeats a number the memory had settled on before it read the evidence.

    True when ``answer`` names a number that is not a gold answer and that one of ``memories_before`` (the
    memories written before the first evidence chunk) already holds: the memory wrote a value for the question
    before the evidence came (made up, or taken from a distractor), and the answer kept it.
    ``early_guess("It is 1.", ["5248280"], ["The number for X is 1."]) is True``.

    Args:
        answer: the extracted answer of a wrong row.
        golds: the gold answers (and target values); their numbers never count.
        memories_before: memory texts written before the first evidence chunk (empty when the evidence is in
            the first chunk: then nothing can have been guessed).
    """
    early = numbers(" ".join(memories_before)) - numbers(" ".join(golds))
    return bool(numbers(answer) & early)


def _digits(number: str) -> int:
    return sum(c.isdigit() for c in number)


def _gold_kind(golds: Sequence[str]) -> tuple[set[str], set[int]]:
    """The gold answers' numbers and their digit counts (a number "of the gold's kind" has one of these)."""
    gold = numbers(" ".join(golds))
    return gold, {_digits(n) for n in gold}


def distractor_answer(answer: str | None, golds: Sequence[str], document: str) -> bool | None:
    """Whether a wrong answer names another number of the document of the gold answer's kind.

    True when ``answer`` names a number that is not a gold answer, occurs in ``document``, and has as many
    digits as a number of the gold answers (RULER's needle values are 7 digits: a 7-digit number of the
    document is another needle's value, a niah_multikey_1 distractor or a multivalue sibling, while a footnote
    "[1]" or a year is not). The memory or the answer confused keys, where an answer naming no such number
    made one up or found nothing. ``None`` when no gold answer holds a number (not measured).
    ``distractor_answer("It is 8041481.", ["5248280"], "... for other-key is: 8041481.") is True``.

    Args:
        answer: the extracted answer of a wrong row.
        golds: the gold answers (and target values); their numbers never count.
        document: the sample's whole context (characters), whatever part of it the method read.
    """
    gold, digits = _gold_kind(golds)
    if not digits:
        return None
    other = (numbers(answer) - gold) & numbers(document)
    return any(_digits(n) in digits for n in other)


def first_distractor_answer(answer: str | None, golds: Sequence[str], document: str) -> bool | None:
    """Whether a wrong answer names the document's first number of the gold answer's kind, and that number is
    not a gold answer: the first needle read was another key's, and the answer kept it.

    The kind is :func:`distractor_answer`'s (as many digits as a gold number); "first" is in reading order of
    the whole document. On niah_multikey_1 it tells a policy that writes the first needle it meets, whatever its
    key, from one that confuses keys anywhere: a first-needle answer is always a distractor answer, not the
    reverse. ``first_distractor_answer("8041481", ["5248280"], "x is: 8041481. y is: 5248280.") is True``.

    Returns:
        ``None`` when no gold answer holds a number (not measured); ``False`` when the document's first such
        number is a gold answer or the answer does not name it.
    """
    gold, digits = _gold_kind(golds)
    if not digits:
        return None
    first = next((n for n in numbers_in_order(document) if _digits(n) in digits), None)
    return first is not None and first not in gold and first in numbers(answer)


def distractors_before(golds: Sequence[str], document: str) -> int | None:
    """How many other numbers of the gold answer's kind the document states before the gold value.

    Counts the distinct numbers with a gold number's digit count (:func:`distractor_answer`'s kind), not gold
    answers, whose first occurrence in reading order precedes the first occurrence of any gold number. On
    niah_multikey_1 it is the asked needle's place among the document's needles: 0 when it comes first, 3 when
    it comes after the three other keys' needles. A memory that writes the first value it reads scores on 0
    and misses the rest; one that overwrites with each new value scores only on the last.
    ``distractors_before(["7654321"], "a 8041481. b 5550001. c 7654321. d 8041481.") == 2``.

    Returns:
        The count, or ``None`` when no gold answer holds a number or no gold number occurs in ``document``
        (not measured).
    """
    gold, digits = _gold_kind(golds)
    if not digits:
        return None
    seen: set[str] = set()
    for n in numbers_in_order(document):
        if n in gold:
            return len(seen)
        if _digits(n) in digits:
            seen.add(n)
    return None
