"""RULER needle-in-a-haystack tasks (niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue, niah_multiquery).

A needle states that one of the special magic numbers/uuids for a key is a value; the question asks for the
value(s) of one or more keys. Haystacks: ``noise`` (one filler line repeated), ``needle`` (many distractor
needles with random keys and values) and ``essay`` (the first N words of the essays, needles put at sentence
boundaries at depths drawn from 40 evenly spaced percentages). The essay haystack is capped at the essay's
length (MemAgent's variant) instead of being repeated.

Source: ruler-tasks.md (task table, needle and template facts).
"""

from __future__ import annotations

from dataclasses import dataclass

from memagent.data.documents import sample_rng
from memagent.data.schema import evidence_item, joined_spans
from memagent.data.ruler.common import (
    DEPTHS,
    NOISE_LINE,
    TOKENS_TO_GENERATE,
    RulerPrompt,
    fit_length,
    insert_at_fractions,
    inserted_indices,
    prefix_from_costs,
    prose_costs,
    random_value,
    split_sentences,
    to_sample,
    unit_costs,
)
from memagent.errors import DataError
from memagent.tokenization import Tokenizer
from memagent.types import Sample


@dataclass(frozen=True)
class NiahConfig:
    """One NIAH variant: haystack, key and value types, number of keys / values per key / queried keys."""

    haystack: str
    key_type: str
    value_type: str
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


NIAH_TASKS = {
    "niah_single_1": NiahConfig("noise", "words", "numbers"),
    "niah_single_2": NiahConfig("essay", "words", "numbers"),
    "niah_single_3": NiahConfig("essay", "words", "uuids"),
    "niah_multikey_1": NiahConfig("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": NiahConfig("needle", "words", "numbers"),
    "niah_multikey_3": NiahConfig("needle", "uuids", "uuids"),
    "niah_multivalue": NiahConfig("essay", "words", "numbers", num_values=4),
    "niah_multiquery": NiahConfig("essay", "words", "numbers", num_queries=4),
}


def _needle(value_type: str, key: str, value: str) -> str:
    return f"One of the special magic {value_type} for {key} is: {value}."


def _distinct(kind: str, n: int, rng) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        x = random_value(kind, rng)
        if x not in out:
            out.append(x)
    return out


def _prompt_text(cfg: NiahConfig, queries: list[str]) -> tuple[str, str, str, str]:
    """(preamble, question line, answer prefix, value type as worded) with RULER's singular wording for a
    single value of a single query."""
    vtype = cfg.value_type
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    if cfg.num_values * cfg.num_queries == 1:
        vtype = vtype[:-1]
        pre = f"A special magic {vtype} is hidden within the following text. Make sure to memorize it. I will quiz you about the {vtype} afterwards."
        q = f"What is the special magic {vtype} for {query} mentioned in the provided text?"
        ans = f" The special magic {vtype} for {query} mentioned in the provided text is"
    else:
        pre = f"Some special magic {vtype} are hidden within the following text. Make sure to memorize it. I will quiz you about the {vtype} afterwards."
        q = f"What are all the special magic {vtype} for {query} mentioned in the provided text?"
        ans = f" The special magic {vtype} for {query} mentioned in the provided text are"
    return pre, q, ans, vtype


def build_niah(task: str, length: int, index: int, tokenizer: Tokenizer, seed: int = 42, haystack: str | None = None,
               data_root: str | None = None, start_word: int = 0, min_depth: int = 0,
               distractors_before: int = 0, distractors_after: int = 0) -> Sample:
    """One NIAH sample whose RULER input fits ``length - 128`` tokens.

    Args:
        task: a key of :data:`NIAH_TASKS`.
        length: target length in tokens (input + tokens to generate, RULER's convention).
        index: sample index; the sample's RNG comes from ``(seed, task, length, index)``.
        tokenizer: the model's tokenizer.
        seed: base seed.
        haystack: replace an ``essay`` haystack by ``gutenberg`` (prose tasks only).
        data_root: explicit data root for the essays.
        start_word: prose haystacks: begin at this word of the text (wrapping around) instead of its first
            (training data draws it, :mod:`memagent.data.ruler.train`; evaluation keeps RULER's 0).
        min_depth: every needle at least this deep, in percent of the context's sentences (prose: from RULER's
            40 depths at or above it) or lines (the uniform draw scaled into ``[min_depth, 100]``); depth counts
            sentences, not tokens. Training data only; 0 leaves the draws exactly as RULER's.
        distractors_before: training data (niah_multikey_1): at least this many other keys' needles come before
            the asked one (:func:`_asked_between`); 0 (with ``distractors_after`` 0) leaves the draws exactly as
            RULER's.
        distractors_after: training data (niah_multikey_1): at least this many other keys' needles come after
            the asked one, so a memory that keeps the last needle it reads loses it.

    Raises:
        DataError: unknown task, ``min_depth`` outside ``[0, 100]``, ``distractors_before`` plus
            ``distractors_after`` not below the task's number of keys, or the length is too small for the needles.
    """
    if task not in NIAH_TASKS:
        raise DataError(f"unknown NIAH task {task!r}")
    cfg = NIAH_TASKS[task]
    if not 0 <= min_depth <= 100:
        raise DataError(f"min_depth is a percentage of the context in [0, 100], got {min_depth}")
    rng = sample_rng(seed, f"{task}/{length}/{index}")
    num_keys = max(cfg.num_keys, cfg.num_queries)
    keys = _distinct(cfg.key_type, num_keys, rng)
    values = [_distinct(cfg.value_type, cfg.num_values, rng) for _ in keys]
    placed = [(_needle(cfg.value_type, k, v), k, v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(placed)  # the permutation depends only on the list's length, as for the needle texts alone
    needles = [text for text, _, _ in placed]
    picked = rng.sample(range(num_keys), cfg.num_queries)
    queries = [keys[i] for i in picked]
    if distractors_before or distractors_after:  # against a policy that keeps the first (last) needle it reads
        placed = _asked_between(placed, queries, distractors_before, distractors_after, task, cfg, rng)
        needles = [text for text, _, _ in placed]
    answers = tuple(v for i in picked for v in values[i])
    pre, qline, ans_prefix, _ = _prompt_text(cfg, queries)
    budget = length - TOKENS_TO_GENERATE["niah"]
    kind = cfg.haystack if cfg.haystack != "essay" or haystack is None else haystack

    if kind in ("essay", "gutenberg"):
        fitted = _fit_prose(kind, needles, _depths(rng, len(needles), min_depth), start_word, pre, qline, budget,
                            tokenizer, data_root)
    else:
        low = min_depth / 100
        fractions = [low + (1 - low) * rng.random() for _ in needles]
        if kind == "noise":
            line_cost = float(unit_costs([NOISE_LINE, NOISE_LINE], "\n", tokenizer)[0])
            max_units = budget // max(1, int(line_cost)) + 10
            units = None
            prefix = lambda n: n * line_cost  # noqa: E731
        else:  # distractor needles from their own stream
            hay_rng = sample_rng(seed, f"{task}/{length}/{index}/haystack")
            max_units = budget // 8 + 10
            units = [_needle(cfg.value_type, random_value(cfg.key_type, hay_rng), random_value(cfg.value_type, hay_rng)) for _ in range(max_units)]
            prefix = prefix_from_costs(unit_costs(units, "\n", tokenizer))

        def build(n: int):
            lines = [NOISE_LINE] * n if units is None else units[:n]
            parts = insert_at_fractions(lines, needles, fractions)
            ctx = "\n".join(parts)
            return (ctx, joined_spans(parts, "\n", inserted_indices(len(lines), fractions))), f"{pre}\n{ctx}\n{qline}"

        fitted = fit_length(build, prefix, max_units, budget, tokenizer, min_units=0)
    ctx, spans = fitted.value
    prompt = RulerPrompt(f"{pre}\n{qline}", pre + "\n", ctx, "\n" + qline, answers, ans_prefix)
    return to_sample(task, length, index, prompt, fitted.tokens, tokenizer, seed, "niah", haystack=kind, haystack_units=fitted.n,
                     evidence=_needle_evidence(ctx, placed, spans, set(queries)))


def _asked_between(placed: list, queries: list[str], before: int, after: int, task: str, cfg: NiahConfig,
                   rng) -> list:
    """Put the asked key's needle behind at least ``before`` and ahead of at least ``after`` other needles of
    ``placed`` (in place, returned; needles enter the context in this list's order, :func:`insert_at_fractions`
    keeps it), swapping it with a needle drawn from the allowed places; no draw when it already is in one (with
    ``after`` 0 the draws are those of ``before`` alone).

    Raises:
        DataError: not one asked key with one value, a negative count, or ``before + after`` other keys missing."""
    num_keys = max(cfg.num_keys, cfg.num_queries)
    if cfg.num_queries != 1 or cfg.num_values != 1 or min(before, after) < 0 or not 0 < before + after < num_keys:
        raise DataError(f"distractors_before={before} and distractors_after={after} need one asked key with one value "
                        f"and more keys than their sum; {task} has {num_keys} key(s), {cfg.num_queries} asked")
    at = next(i for i, (_, k, _) in enumerate(placed) if k == queries[0])
    end = len(placed) - after
    if not before <= at < end:
        to = rng.randrange(before, end)
        placed[at], placed[to] = placed[to], placed[at]
    return placed


def _depths(rng, n: int, min_depth: int) -> list[int]:
    """``n`` distinct depths (percent, sorted) from RULER's 40 at or above ``min_depth`` (all 40 at 0: RULER's draw).

    Raises:
        DataError: fewer than ``n`` depths are left."""
    pool = [d for d in DEPTHS if d >= min_depth]
    if len(pool) < n:
        raise DataError(f"min_depth {min_depth} leaves {len(pool)} of RULER's depths for {n} needles")
    return sorted(rng.sample(pool, n))


def _needle_evidence(ctx: str, placed, spans, queried: set[str]) -> list[dict]:
    """The needles of the queried keys, in context order: span, sentence, key and value (the gold answer).
    Needles of keys the question does not ask about (niah_multikey_1) are distractors and left out."""
    items = [evidence_item(ctx, a, b, "needle", answer=value, key=key)
             for (_, key, value), (a, b) in zip(placed, spans) if key in queried]
    return sorted(items, key=lambda e: e["start_char"])


def _fit_prose(kind: str, needles: list[str], depths: list[int], start_word: int, pre: str, qline: str, budget: int,
               tokenizer: Tokenizer, data_root: str | None):
    """Fit a prose haystack (essays or Gutenberg, from word ``start_word`` on, wrapping around the text) with the
    needles at ``depths`` (percent) to ``budget`` tokens (:func:`fit_length`; its value is ``(context, needle
    spans)``)."""
    costs = prose_costs(kind, tokenizer, data_root)
    start = start_word % len(costs.words)
    words = costs.words[start:] + costs.words[:start] if start else costs.words
    base = float(costs.prefix_tokens[start])

    def build(n: int):
        sents = split_sentences(" ".join(words[:n]))
        fractions = [d / 100 for d in depths]
        parts = insert_at_fractions(sents, needles, fractions)
        ctx = " ".join(parts)
        return (ctx, joined_spans(parts, " ", inserted_indices(len(sents), fractions))), f"{pre}\n{ctx}\n{qline}"

    def estimate(n: int) -> float:  # tokens of words[:n], from the whole text's prefix sums (wrapping once)
        end = start + min(n, len(words))
        total = float(costs.prefix_tokens[-1])
        return (float(costs.prefix_tokens[end]) if end <= len(words) else total + float(costs.prefix_tokens[end - len(words)])) - base

    return fit_length(build, estimate, len(words), budget, tokenizer)
