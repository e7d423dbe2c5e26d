"""RULER qa_1 (SQuAD 2.0) and qa_2 (HotpotQA): a question's paragraph(s) among many distractor paragraphs.

Sample i uses the i-th answerable question; distractors are (SQuAD only) the other paragraphs of the same
article first, then random paragraphs of the pool; documents are shuffled with the sample's own RNG (RULER
uses one seed per generator chunk, MemAgent's copy inherits it: reference doc section 6 item 6) and rendered
as ``Document i:`` blocks. The number of documents is fitted to the length (see
:func:`memagent.data.documents.fit_documents`).

Source: ruler-tasks.md (qa_1, qa_2).
"""

from __future__ import annotations

import functools

from memagent.data import paths
from memagent.data.documents import LengthTooShort, fit_documents, sample_rng
from memagent.data.hotpotqa import build_pool, load_hotpotqa, paragraph_document
from memagent.data.ruler.common import TOKENS_TO_GENERATE, RulerPrompt, to_sample
from memagent.data.squad import load_squad, squad_pool
from memagent.errors import DataError
from memagent.tokenization import Tokenizer, count_tokens
from memagent.types import Sample

INSTRUCTION = "Answer the question based on the given documents. Only give me the answer and do not output any other words."


@functools.lru_cache(maxsize=2)
def _source(task: str, data_root: str | None):
    if task == "qa_1":
        questions, articles = load_squad(paths.data_file(paths.SQUAD_DEV, data_root))
        pool = squad_pool(articles, data_root)
        return [(q.id, q.question, q.answers, [q.paragraph], [p for p in articles[q.title] if p != q.paragraph], [q.paragraph])
                for q in questions], pool
    records = load_hotpotqa(paths.data_file(paths.HOTPOTQA_DEV, data_root))
    pool = build_pool(records, name="hotpotqa-dev")
    usable = [r for r in records if len(r.paragraphs) >= 2 and not r.missing_gold]  # answerable from its context
    return [(r.id, r.question, (r.answer,), r.documents, [], [paragraph_document(t, x) for t, x in r.paragraphs if t in r.gold_titles])
            for r in usable], pool


def build_qa(task: str, length: int, index: int, tokenizer: Tokenizer, seed: int = 42, data_root: str | None = None, **_) -> Sample:
    """One qa sample whose RULER input fits ``length - 32`` tokens.

    Raises:
        DataError: ``index`` beyond the questions available, or missing data.
    """
    questions, pool = _source(task, None if data_root is None else str(data_root))
    if index >= len(questions):
        raise DataError(f"{task}: only {len(questions)} questions available, asked for index {index}")
    qid, question, answers, own, more, gold = questions[index]
    prefix = f"{INSTRUCTION}\n\nThe following are given documents.\n\n"
    suffix = f"\n\n{INSTRUCTION}\n\nQuestion: {question}"
    budget = length - TOKENS_TO_GENERATE["qa"]
    fixed = count_tokens(tokenizer, prefix) + count_tokens(tokenizer, suffix)
    for _ in range(4):
        try:
            ctx = fit_documents(own, pool, budget, rng=sample_rng(seed, f"{task}/{length}/{index}/docs"),
                                tokenizer=tokenizer, more=more, fixed_tokens=fixed)
        except LengthTooShort as e:  # the caller names the sample and gathers all (memagent.data.documents.build_all)
            raise LengthTooShort(f"question {qid!r}: {e}", e.short) from None
        except DataError as e:
            raise DataError(f"sample {index} (question {qid!r}): {e}") from None
        tokens = count_tokens(tokenizer, prefix + ctx.context + suffix)
        if tokens <= budget:
            break
        fixed += tokens - budget  # joins tokenized differently: shrink and refit
    else:
        raise DataError(f"{task}: could not fit sample {index} into {length} tokens")
    prompt = RulerPrompt(f"Answer the question based on the given documents.\n\nQuestion: {question}", prefix, ctx.context, suffix, tuple(answers), " Answer:")
    return to_sample(
        task, length, index, prompt, tokens, tokenizer, seed, "qa",
        source=f"{pool.name}:{qid}", num_docs=len(ctx.docs), own_positions=list(ctx.own_positions),
        evidence=ctx.evidence(gold, "gold_paragraph"),
    )
