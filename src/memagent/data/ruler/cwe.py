"""RULER common words extraction (cwe): name the 10 words that appear most often in a long numbered list.

10 common words appear 30 times each and every other word 3 times (6 and 1 below 4K tokens); the number of
other words grows with the length. Words come from wonderwords' nouns, adjectives and verbs; one solved
example (with disjoint words) precedes the task in the RULER input. RULER falls back to a larger English
word list when wonderwords runs out; here the vocabulary (~8,000 words) bounds the length at about 128K
tokens, and a longer request is an error.

Source: ruler-tasks.md (cwe).
"""

from __future__ import annotations

from memagent.data.documents import sample_rng
from memagent.data.ruler.common import TOKENS_TO_GENERATE, RulerPrompt, common_vocabulary, fit_length, to_sample
from memagent.errors import DataError
from memagent.tokenization import Tokenizer, count_tokens
from memagent.types import Sample

NUM_COMMON = 10
INSTRUCTION = "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often."
QUESTION = f"Question: What are the {NUM_COMMON} most common words in the above list?"
ANSWER_PREFIX = f" Answer: The top {NUM_COMMON} words that appear most often in the list are:"


def _numbered(words: list[str]) -> str:
    return "\n".join(f"{i}. {w}" for i, w in enumerate(words, 1))


def build_cwe(task: str, length: int, index: int, tokenizer: Tokenizer, seed: int = 42, **_) -> Sample:
    """One cwe sample whose RULER input fits ``length - 120`` tokens.

    Raises:
        DataError: the vocabulary is too small for the length.
    """
    freq_common, freq_other = (30, 3) if length >= 4096 else (6, 1)
    rng = sample_rng(seed, f"{task}/{length}/{index}")
    vocab = list(common_vocabulary())
    rng.shuffle(vocab)
    ex_common, ex_other = vocab[:NUM_COMMON], vocab[NUM_COMMON : 2 * NUM_COMMON]
    ex_list = ex_common * 3 + ex_other
    rng.shuffle(ex_list)
    example = f"{INSTRUCTION}\n{_numbered(ex_list)}\n{QUESTION}{ANSWER_PREFIX} {', '.join(ex_common)}\n\n"
    common, others = vocab[2 * NUM_COMMON : 3 * NUM_COMMON], vocab[3 * NUM_COMMON :]
    prefix, suffix = f"{example}{INSTRUCTION}\n", "\n" + QUESTION

    def build(n: int):
        items = common * freq_common + others[:n] * freq_other
        sample_rng(seed, f"{task}/{length}/{index}/{n}").shuffle(items)
        ctx = _numbered(items)
        return ctx, prefix + ctx + suffix

    # tokens per list item, measured once on a list of this task's size
    probe_items = max(50, length // 8)
    probe = _numbered((vocab * (probe_items // len(vocab) + 1))[:probe_items])
    per_item = count_tokens(tokenizer, probe) / probe_items
    fixed_items = NUM_COMMON * freq_common
    budget = length - TOKENS_TO_GENERATE["common_words_extraction"]
    fitted = fit_length(build, lambda n: (fixed_items + freq_other * n) * per_item, len(others), budget, tokenizer, min_units=0)
    if fitted.n >= len(others) and budget - fitted.tokens > max(20, budget // 200):
        raise DataError(f"cwe: the word list ({len(vocab)} words) is too small for {length} tokens")
    prompt = RulerPrompt(f"{INSTRUCTION}\n{QUESTION}", prefix, str(fitted.value), suffix, tuple(common), ANSWER_PREFIX)
    return to_sample(task, length, index, prompt, fitted.tokens, tokenizer, seed, "common_words_extraction", haystack_units=fitted.n)
