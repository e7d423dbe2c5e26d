"""RULER frequent words extraction (fwe): name the three most frequent "coded words" of a long text.

A vocabulary of ``length // 50`` random 6-letter lower-case words is shuffled; word of rank k appears
``floor(N * k^-2 / zeta(2))`` times (Zipf law, alpha = 2), the rank-1 word is replaced by ``...`` as noise,
and the words are shuffled and joined by spaces. The answer is the words of ranks 2-4. ``N`` grows with the
length.

Source: ruler-tasks.md (fwe).
"""

from __future__ import annotations

import math
import string

import numpy as np

from memagent.data.documents import sample_rng
from memagent.data.ruler.common import TOKENS_TO_GENERATE, RulerPrompt, fit_length, to_sample, unit_costs
from memagent.tokenization import Tokenizer
from memagent.types import Sample

ALPHA = 2.0
WORD_CHARS = 6
ZETA_2 = math.pi**2 / 6
INSTRUCTION = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words."
)
QUESTION = (
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"


def _counts(num_words: int, vocab_size: int) -> np.ndarray:
    k = np.arange(1, vocab_size + 1, dtype=np.float64)
    return np.floor(num_words * k**-ALPHA / ZETA_2).astype(np.int64)


def build_fwe(task: str, length: int, index: int, tokenizer: Tokenizer, seed: int = 42, **_) -> Sample:
    """One fwe sample whose RULER input fits ``length - 50`` tokens."""
    rng = sample_rng(seed, f"{task}/{length}/{index}")
    vocab_size = max(10, length // 50)
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=WORD_CHARS)))
    words = sorted(vocab)
    rng.shuffle(words)
    words[0] = "..."
    costs = unit_costs(words, " ", tokenizer)
    prefix, suffix = f"{INSTRUCTION} ", "\n" + QUESTION

    def build(n: int):
        items = [w for w, c in zip(words, _counts(n, vocab_size)) for _ in range(int(c))]
        sample_rng(seed, f"{task}/{length}/{index}/{n}").shuffle(items)
        ctx = " ".join(items)
        return ctx, prefix + ctx + suffix

    budget = length - TOKENS_TO_GENERATE["freq_words_extraction"]
    est = lambda n: float(_counts(n, vocab_size) @ costs)  # noqa: E731
    fitted = fit_length(build, est, budget * 4, budget, tokenizer, min_units=0)
    prompt = RulerPrompt(f"{INSTRUCTION}\n{QUESTION}", prefix, str(fitted.value), suffix, tuple(words[1:4]), ANSWER_PREFIX)
    return to_sample(task, length, index, prompt, fitted.tokens, tokenizer, seed, "freq_words_extraction", haystack_units=fitted.n)
