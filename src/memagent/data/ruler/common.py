"""Shared pieces of the RULER task builders: word lists, haystacks, sentence splitting, random values and
fitting a sample to a token length.

Fitting (:func:`fit_length`): every task builds its prompt from ``n`` haystack units (words, lines, list
items, documents) through a pure function ``build(n)``. The token cost of each unit is known in advance (each
distinct unit tokenized once, or one tokenization of the whole essay, cached), so prefix sums estimate the
prompt length for any ``n``; the prompt is then tokenized exactly, and ``n`` is corrected from the measured
error. A sample costs two or three full tokenizations, never one per step of a search. RULER instead
re-tokenizes the whole prompt at every step of its search (ruler-tasks.md).

Source: ruler-tasks.md (RULER's configuration and MemAgent's variants).
"""

from __future__ import annotations

import functools
import json
import random
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from memagent.data import paths
from memagent.errors import DataError
from memagent.tokenization import Tokenizer, count_tokens
from memagent.types import Sample

#: Tokens reserved for the answer per task family (RULER ``data/synthetic/constants.py``).
TOKENS_TO_GENERATE = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120, "freq_words_extraction": 50, "qa": 32}

#: RULER's filler line for the ``noise`` (MemAgent: ``repeat``) haystack, also used by vt.
NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

#: Needle depths: 40 evenly spaced percentages from 0 to 100 (rounded), as in RULER.
DEPTHS = tuple(int(x) for x in np.round(np.linspace(0, 100, num=40)))

_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?= [\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Split prose into sentences without any download (a regex stand-in for NLTK's ``sent_tokenize``).

    A sentence ends at ``.``, ``!`` or ``?`` (optionally followed by closing quotes/brackets) when whitespace
    and an upper-case letter, digit or opening quote follow. Joining the result with single spaces gives back
    the text with its whitespace collapsed.
    """
    text = " ".join(text.split())
    out, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        out.append(text[start : m.end()])
        start = m.end() + 1  # skip the single space
    if start < len(text):
        out.append(text[start:])
    return out


def _asset_words(name: str) -> list[str]:
    files = resources.files("wonderwords") / "assets" / name
    return [w.strip() for w in files.read_text(encoding="utf-8").splitlines() if w.strip()]


@functools.lru_cache(maxsize=1)
def word_lists() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(nouns, adjectives, verbs) from the ``wonderwords`` package's lists, sorted and de-duplicated.

    Raises:
        DataError: ``wonderwords`` is not installed.
    """
    try:
        return tuple(tuple(sorted(set(_asset_words(f)))) for f in ("nounlist.txt", "adjectivelist.txt", "verblist.txt"))  # type: ignore[return-value]
    except ModuleNotFoundError:
        raise DataError("the RULER builders need the 'wonderwords' package: pip install 'memagent[eval]'") from None


@functools.lru_cache(maxsize=1)
def common_vocabulary() -> tuple[str, ...]:
    """Nouns + adjectives + verbs (single lower-case words), sorted, de-duplicated: the cwe vocabulary."""
    nouns, adjs, verbs = word_lists()
    return tuple(sorted({w.lower() for w in (*nouns, *adjs, *verbs) if w.isalpha()}))


def random_value(kind: str, rng: random.Random) -> str:
    """A random key or value: ``words`` (adjective-noun), ``numbers`` (7 digits) or ``uuids`` (version 4)."""
    if kind == "words":  # uniform over all adjective-noun pairs (RULER's word keys)
        nouns, adjs, _ = word_lists()
        return f"{adjs[rng.randrange(len(adjs))]}-{nouns[rng.randrange(len(nouns))]}"
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise DataError(f"unknown needle type {kind!r}: use words, numbers or uuids")


@functools.lru_cache(maxsize=4)
def haystack_text(kind: str, data_root: str | None = None) -> str:
    """The prose haystack with whitespace collapsed to single spaces.

    Args:
        kind: ``essay`` (Paul Graham essays, RULER's default) or ``gutenberg`` (public-domain novels).
        data_root: explicit data root (see :func:`memagent.data.paths.data_root`).

    Raises:
        DataError: unknown kind or missing files.
    """
    if kind == "essay":
        with open(paths.data_file(paths.PG_ESSAYS, data_root), encoding="utf-8") as f:
            text = json.load(f)["text"]
    elif kind == "gutenberg":
        folder = paths.data_file(paths.GUTENBERG_DIR, data_root)
        text = " ".join(p.read_text(encoding="utf-8") for p in sorted(Path(folder).glob("*.txt")) if p.name != "SOURCE_README.txt")
    else:
        raise DataError(f"unknown haystack {kind!r}: use essay or gutenberg")
    return " ".join(text.split())


@dataclass(frozen=True)
class ProseCosts:
    """Token costs of a prose haystack's words, from one tokenization of the whole text.

    Attributes:
        words: the whitespace-separated words.
        prefix_tokens: ``prefix_tokens[n]`` ~ tokens of the first ``n`` words joined by spaces, shape ``(W + 1,)``.
    """

    words: tuple[str, ...]
    prefix_tokens: np.ndarray


_PROSE_CACHE: dict[tuple[str, str | None, str], ProseCosts] = {}


def prose_costs(kind: str, tokenizer: Tokenizer, data_root: str | None = None) -> ProseCosts:
    """Word costs of a haystack for a tokenizer (computed once per process and cached)."""
    key = (kind, data_root, tokenizer.name)
    if key not in _PROSE_CACHE:
        text = haystack_text(kind, data_root)
        words = tuple(text.split(" "))
        _, bounds = tokenizer.encode_with_offsets(text)
        starts = np.asarray(bounds[:-1])
        word_end = np.cumsum([len(w) + 1 for w in words]) - 1  # char offset after each word
        prefix = np.concatenate([[0], np.searchsorted(starts, word_end, side="left")])
        _PROSE_CACHE[key] = ProseCosts(words, prefix)
    return _PROSE_CACHE[key]


@dataclass(frozen=True)
class Fitted:
    """A prompt fitted to a budget: ``n`` units, its text (whatever ``build`` returns) and exact tokens."""

    n: int
    value: object
    tokens: int


def fit_length(
    build: Callable[[int], tuple[object, str]],
    prefix_tokens: Callable[[int], float],
    max_units: int,
    budget_tokens: int,
    tokenizer: Tokenizer,
    min_units: int = 1,
    tolerance_tokens: int | None = None,
) -> Fitted:
    """The largest unit count whose prompt fits ``budget_tokens``, found from estimates plus exact counts.

    Args:
        build: ``n -> (value, prompt_text)``; must be a pure function of ``n``.
        prefix_tokens: ``n -> estimated tokens of the n units`` (non-decreasing in ``n``).
        max_units: most units available.
        budget_tokens: the prompt's token limit.
        tokenizer: measures the prompt exactly.
        min_units: fewest units allowed.
        tolerance_tokens: accept a prompt at most this far below the budget (default ~0.5% of it, >= 20).

    Returns:
        The fitted prompt; its exact token count is <= ``budget_tokens``.

    Raises:
        DataError: even ``min_units`` units overflow the budget, or all ``max_units`` units fall short of it by more
            than the tolerance (the haystack is too small for the length).
    """
    if budget_tokens < 1:
        raise DataError(f"the target length leaves {budget_tokens} tokens for the prompt once the answer's tokens "
                        "are set aside (RULER counts input + answer): use a longer length")
    tol = tolerance_tokens if tolerance_tokens is not None else max(20, budget_tokens // 200)
    _, base_text = build(0)
    base = count_tokens(tokenizer, base_text)  # fixed part of the prompt

    def units_for(tokens: float) -> int:  # most n whose estimated cost is <= tokens
        lo, hi = 0, max_units
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if prefix_tokens(mid) <= tokens:
                lo = mid
            else:
                hi = mid - 1
        return lo

    n = max(min_units, units_for(budget_tokens - base))
    best: Fitted | None = None
    tried: set[int] = set()
    while n not in tried and len(tried) < 12:
        tried.add(n)
        value, text = build(n)
        exact = count_tokens(tokenizer, text)
        if exact <= budget_tokens:
            if best is None or n > best.n:
                best = Fitted(n, value, exact)
            if budget_tokens - exact <= tol or n >= max_units:
                break
            n = min(max_units, units_for(prefix_tokens(n) + (budget_tokens - exact)))
            if best is not None and n <= best.n:
                n = best.n + 1  # the estimate is stuck: try one unit more
        else:
            if n <= min_units:
                break
            n = max(min_units, min(n - 1, units_for(prefix_tokens(n) - (exact - budget_tokens))))
            if best is not None and n <= best.n:
                break
    if best is None:
        raise DataError(f"the prompt with only {min_units} haystack units is {exact} tokens, over the budget of "
                        f"{budget_tokens} tokens (the target length minus the answer's tokens): use a longer length")
    if best.n >= max_units and budget_tokens - best.tokens > tol:  # the haystack ran out well short of the length
        raise DataError(f"the haystack holds {max_units} units, a prompt of {best.tokens} tokens, short of the "
                        f"{budget_tokens}-token budget of this length: use a length of at most about "
                        f"{best.tokens} tokens")
    return best


def prefix_from_costs(costs: Sequence[float]) -> Callable[[int], float]:
    """``n -> sum(costs[:n])`` in O(1) (precomputed prefix sums)."""
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=np.float64))])
    return lambda n: float(prefix[min(n, len(prefix) - 1)])


def insert_at_fractions(items: list[str], inserts: Sequence[str], fractions: Sequence[float]) -> list[str]:
    """Insert ``inserts[i]`` before position ``int(fractions[i] * len(items))`` (fractions sorted internally,
    inserts keep their order)."""
    out = list(items)
    positions = sorted(int(f * len(items)) for f in fractions)
    for offset, (pos, x) in enumerate(zip(positions, inserts)):
        out.insert(pos + offset, x)
    return out


def inserted_indices(num_items: int, fractions: Sequence[float]) -> list[int]:
    """Where :func:`insert_at_fractions` puts its inserts: the index in the output list of each insert, in the
    inserts' order (the ``k``-th insert lands at the ``k``-th smallest position plus ``k``)."""
    positions = sorted(int(f * num_items) for f in fractions)
    return [pos + k for k, pos in enumerate(positions)]


def unit_costs(units: Sequence[str], sep: str, tokenizer: Tokenizer) -> np.ndarray:
    """Approximate tokens of each unit inside ``sep.join(units)`` from one tokenization with offsets (a token
    belongs to the unit where it starts; the separator after a unit counts to it). Shape ``(U,)``."""
    if not units:
        return np.zeros(0)
    text = sep.join(units)
    _, bounds = tokenizer.encode_with_offsets(text)
    starts = np.asarray(bounds[:-1])
    ends = np.cumsum([len(u) + len(sep) for u in units])
    counts = np.searchsorted(starts, ends, side="left")
    return np.diff(np.concatenate([[0], counts])).astype(np.float64)


@dataclass(frozen=True)
class RulerPrompt:
    """One RULER sample before it becomes a :class:`Sample`.

    The RULER input is ``prefix + context + suffix``; memagent's question is ``question`` (the instruction and
    the query without the context, as in MemAgent's variant of RULER).
    """

    question: str
    prefix: str
    context: str
    suffix: str
    answers: tuple[str, ...]
    answer_prefix: str

    @property
    def ruler_input(self) -> str:
        return self.prefix + self.context + self.suffix


def to_sample(task: str, length: int, index: int, prompt: RulerPrompt, tokens: int, tokenizer: Tokenizer, seed: int, family: str, **extra) -> Sample:
    """Wrap a fitted prompt as a Sample; metadata records lengths, tokenizer, seed and the RULER template."""
    meta = {
        "task": task,
        "target_tokens": length,
        "length_tokens": tokens,
        "tokens_to_generate": TOKENS_TO_GENERATE[family],
        "tokenizer": tokenizer.name,
        "seed": seed,
        "index": index,
        "answer_prefix": prompt.answer_prefix,
        "ruler_prefix": prompt.prefix,
        "ruler_suffix": prompt.suffix,
        **extra,
    }
    return Sample(f"{task}-{length}-{index}", prompt.question, prompt.context, prompt.answers, meta)


def ruler_record(sample: Sample) -> dict:
    """RULER's JSONL record of a sample: ``index, input, outputs, length`` (+ ``answer_prefix``); ``length``
    counts the input tokens plus the tokens to generate, as RULER does."""
    m = sample.metadata
    return {
        "index": m["index"],
        "input": m["ruler_prefix"] + sample.context + m["ruler_suffix"],
        "outputs": list(sample.answers),
        "length": m["length_tokens"] + m["tokens_to_generate"],
        "answer_prefix": m["answer_prefix"],
    }
