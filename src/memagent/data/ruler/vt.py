"""RULER variable tracking (vt): follow a chain of variable assignments hidden in filler text.

One chain of 4 hops: ``VAR A = <5-digit number>``, then ``VAR B = VAR A``, ... (5 variables of 5 random
upper-case letters), its lines scattered in order through repeated filler lines. The answer is the 5 variable
names. One short solved example with its own chain is put before the task in the RULER input (not in
memagent's question, which every agent turn repeats).

Source: ruler-tasks.md (vt).
"""

from __future__ import annotations

import string

from memagent.data.documents import sample_rng
from memagent.data.schema import evidence_item, joined_spans
from memagent.data.ruler.common import (
    NOISE_LINE,
    TOKENS_TO_GENERATE,
    RulerPrompt,
    fit_length,
    insert_at_fractions,
    inserted_indices,
    to_sample,
    unit_costs,
)
from memagent.tokenization import Tokenizer
from memagent.types import Sample

NUM_HOPS = 4
INSTRUCTION = "Memorize and track the chain(s) of variable assignment hidden in the following text."


def _chain(rng, taken: set[str]) -> tuple[list[str], str, list[str]]:
    names: list[str] = []
    while len(names) < NUM_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in taken:
            taken.add(name)
            names.append(name)
    value = str(rng.randint(10000, 99999))
    lines = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i + 1]} = VAR {names[i]}" for i in range(NUM_HOPS)]
    return names, value, lines


def _question(value: str) -> str:
    return f"Question: Find all variables that are assigned the value {value} in the text above."


def _answer_prefix(value: str) -> str:
    return (
        " Answer: According to the chain(s) of variable assignment in the text above, "
        f"{NUM_HOPS + 1} variables are assigned the value {value}, they are: "
    )


def build_vt(task: str, length: int, index: int, tokenizer: Tokenizer, seed: int = 42, **_) -> Sample:
    """One vt sample whose RULER input fits ``length - 30`` tokens (see :func:`memagent.data.ruler.niah.build_niah`
    for the arguments)."""
    rng = sample_rng(seed, f"{task}/{length}/{index}")
    taken: set[str] = set()
    ex_names, ex_value, ex_lines = _chain(rng, taken)
    names, value, lines = _chain(rng, taken)
    ex_ctx = "\n".join(insert_at_fractions([NOISE_LINE] * 5, ex_lines, sorted(rng.random() for _ in ex_lines)))
    example = f"{INSTRUCTION}\n\n{ex_ctx}\n{_question(ex_value)}{_answer_prefix(ex_value)}{' '.join(ex_names)}\n\n"
    fractions = sorted(rng.random() for _ in lines)
    prefix, suffix = f"{example}{INSTRUCTION}\n\n", "\n" + _question(value)

    def build(n: int):
        parts = insert_at_fractions([NOISE_LINE] * n, lines, fractions)
        ctx = "\n".join(parts)
        return (ctx, joined_spans(parts, "\n", inserted_indices(n, fractions))), prefix + ctx + suffix

    line_cost = float(unit_costs([NOISE_LINE, NOISE_LINE], "\n", tokenizer)[0])
    budget = length - TOKENS_TO_GENERATE["variable_tracking"]
    fitted = fit_length(build, lambda n: n * line_cost, budget // max(1, int(line_cost)) + 10, budget, tokenizer, min_units=0)
    ctx, spans = fitted.value
    prompt = RulerPrompt(f"{INSTRUCTION}\n{_question(value)}", prefix, ctx, suffix, tuple(names), _answer_prefix(value))
    # the chain in order: line i assigns variable names[i] (the first the value, each next the one before)
    evidence = [evidence_item(ctx, a, b, "assignment", answer=name, hop=i) for i, (name, (a, b)) in enumerate(zip(names, spans))]
    return to_sample(task, length, index, prompt, fitted.tokens, tokenizer, seed, "variable_tracking", haystack="noise",
                     haystack_units=fitted.n, evidence=evidence)
