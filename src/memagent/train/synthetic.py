"""A small RULER-style needle task generated on the fly, for CPU training runs.

Each document is a haystack of plain filler sentences with one "needle" sentence, ``The special magic
number for <key> is <7 digits>.``, at a random position; the question asks for the key's number. With short
chunks the agent must carry the number in its memory from the chunk that holds it to the final answer.
Generation is seeded per sample, so a sample id always yields the same document.
"""

from __future__ import annotations

import random

from memagent.data.schema import evidence_item, joined_spans
from memagent.types import Sample

_KEYS = (
    "apple", "river", "candle", "violet", "harbor", "pencil", "falcon", "meadow", "copper", "lantern",
    "orchid", "summit", "glacier", "cobalt", "willow", "saffron", "marble", "thunder", "velvet", "ember",
)
_FILLER = (
    "The grass is green and the sky is blue.",
    "The sun rises in the east and sets in the west.",
    "Rivers flow slowly toward the distant sea.",
    "A quiet town sits at the foot of the hills.",
    "Birds sing early in the morning.",
    "The market opens every day at nine.",
    "Old trees line the road to the village.",
    "Clouds drift over the fields in summer.",
)


def needle_sample(index: int, context_words: int, seed: int = 0, prefix: str = "needle") -> Sample:
    """One needle question over a haystack of about ``context_words`` words.

    Args:
        index: sample number (part of the id and of the seed).
        context_words: haystack length in words (approximate: whole sentences).
        seed: task seed.
        prefix: id prefix (e.g. ``"train"``, ``"val"``).
    """
    rng = random.Random(f"{seed}/{prefix}/{index}")
    key = rng.choice(_KEYS)
    value = str(rng.randint(1_000_000, 9_999_999))
    sentences: list[str] = []
    words = 0
    while words < context_words:
        s = rng.choice(_FILLER)
        sentences.append(s)
        words += len(s.split())
    pos = rng.randint(0, len(sentences))
    sentences.insert(pos, f"The special magic number for {key} is {value}.")
    question = f"What is the special magic number for {key} mentioned in the document?"
    context = " ".join(sentences)
    ((a, b),) = joined_spans(sentences, " ", [pos])
    evidence = [evidence_item(context, a, b, "needle", answer=value, key=key)]
    return Sample(f"{prefix}-{index}", question, context, (value,),
                  {"task": "needle", "context_words": context_words, "needle_sentence": pos, "evidence": evidence})


def needle_samples(n: int, context_words: int, seed: int = 0, prefix: str = "needle") -> list[Sample]:
    """``n`` needle samples (see :func:`needle_sample`)."""
    return [needle_sample(i, context_words, seed, prefix) for i in range(n)]
