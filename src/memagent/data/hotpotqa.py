"""RULER-HotpotQA: a HotpotQA question with its paragraphs hidden among many distractor paragraphs.

Recipe (reference doc sections 3.2 and 3.4): every paragraph of every question of a split becomes a document
``title + "\\n" + "".join(sentences)``; the split's unique documents form the distractor pool. A sample is the
question's own paragraphs (all of them: the 2 gold + the HotpotQA distractors) plus distractors drawn from the
rest of the pool without replacement, shuffled and rendered as ``Document i:`` blocks. The size is either a
number of documents (the paper's 50 ... 25600, about 141 Qwen2.5 tokens each) or a target token length.

Differences from the reference: the shuffle and draws use one RNG per sample from ``(seed, sample id)`` (the
reference reuses ``Random(4)`` for every shuffle, so the own paragraphs sit in the same slots for every
question; section 6 item 6); asking for more documents than the pool holds is an error unless reuse is allowed
(the reference silently uses the whole pool). The local dev subset's pool has 19,033 paragraphs (the full dev
file: 66,635), so up to about 19,000 documents (~2.7M tokens) can be built without reuse.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memagent.data import paths
from memagent.data.documents import DocumentPool, build_all, draw_documents, fit_documents, sample_rng
from memagent.data.io import write_records, write_samples
from memagent.data.schema import token_stats, write_manifest
from memagent.errors import DataError
from memagent.tokenization import Tokenizer
from memagent.types import Sample

#: The paper's document counts (reference doc section 2.1).
PAPER_NUM_DOCS = (50, 100, 200, 400, 800, 1600, 3200, 6400, 12800, 25600)


@dataclass(frozen=True)
class HotpotRecord:
    """One HotpotQA question with its distractor-setting paragraphs.

    Attributes:
        id: ``dev_index`` when known, else the HotpotQA ``_id``, else the line number.
        question, answer: as in HotpotQA.
        paragraphs: ``(title, text)`` pairs, text = joined sentences.
        gold_titles: titles of the supporting paragraphs (empty when the file has no ``supporting_facts``).
    """

    id: str
    question: str
    answer: str
    paragraphs: tuple[tuple[str, str], ...]
    gold_titles: frozenset[str]

    @property
    def documents(self) -> list[str]:
        return [paragraph_document(t, x) for t, x in self.paragraphs]

    @property
    def missing_gold(self) -> frozenset[str]:
        """Supporting-paragraph titles absent from ``paragraphs``: such a question cannot be answered from its
        context. Some copies of the dev file lack one or both gold paragraphs (688 of the 1,968 records of the
        local dev subset); the official distractor file always has them."""
        return self.gold_titles - {t for t, _ in self.paragraphs}


def paragraph_document(title: str, text: str) -> str:
    """A paragraph as a document: ``title\\n<text>`` (reference doc section 3.2)."""
    return f"{title}\n{text}"


def load_hotpotqa(path: str | os.PathLike) -> list[HotpotRecord]:
    """Read a HotpotQA distractor file: the official JSON list, our JSONL subset (one record per line) or a
    Hugging Face ``datasets`` export (``id``, ``context: {title, sentences}``).

    A record's id (which seeds its sample's draws) is its ``dev_index``, ``_id`` or ``id``, else its place in
    the file (0, 1, ...), never the file's path: the same records give the same samples wherever they lie.

    Raises:
        DataError: missing file, or a record without question/answer/context or with a question or answer
            that is not a non-empty string (names file, line, field).
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"HotpotQA file {str(p)!r} not found")
    from memagent.data.io import iter_records

    out = []
    for n, (where, r) in enumerate(iter_records(p)):  # invalid JSON or text is a DataError naming file and line
        if not isinstance(r, dict):
            raise DataError(f"{where}: expected a HotpotQA record (a JSON object), got {type(r).__name__}")
        for key in ("question", "answer", "context"):
            if key not in r:
                raise DataError(f"{where}: missing field {key!r}")
        for key in ("question", "answer"):
            if not isinstance(r[key], str) or not r[key].strip():
                raise DataError(f"{where}: field {key!r} must be a non-empty string, got {r[key]!r}")
        ctx = r["context"]
        try:
            if isinstance(ctx, dict):  # HF layout: {"title": [...], "sentences": [[...]]}
                ctx = list(zip(ctx["title"], ctx["sentences"]))
            paras = tuple((str(t), "".join(sents)) for t, sents in ctx)
        except (KeyError, TypeError, ValueError):
            raise DataError(f"{where}: field 'context' must be [[title, [sentence, ...]], ...] (or the HF layout "
                            "{title: [...], sentences: [[...]]})") from None
        facts = r.get("supporting_facts") or []
        try:
            if isinstance(facts, dict):  # HF layout: {"title": [...], "sent_id": [...]}
                facts = list(zip(facts["title"], facts["sent_id"]))
            gold = frozenset(str(t) for t, _ in facts)
        except (KeyError, TypeError, ValueError):
            raise DataError(f"{where}: field 'supporting_facts' must be [[title, sentence_id], ...] (or the HF layout "
                            "{title: [...], sent_id: [...]})") from None
        rid = next((r[k] for k in ("dev_index", "_id", "id") if r.get(k) not in (None, "")), n)
        out.append(HotpotRecord(str(rid), r["question"], r["answer"], paras, gold))
    return out


def build_pool(records: Sequence[HotpotRecord], name: str = "") -> DocumentPool:
    """The sorted unique documents of all records (reference doc section 3.2)."""
    return DocumentPool.from_texts((d for r in records for d in r.documents), name=name)


def build_sample(
    record: HotpotRecord,
    pool: DocumentPool,
    tokenizer: Tokenizer | None,
    seed: int = 0,
    num_docs: int | None = None,
    target_tokens: int | None = None,
    allow_reuse: bool = False,
) -> Sample:
    """One RULER-HotpotQA sample of ``num_docs`` documents or of at most ``target_tokens`` context tokens.

    Args:
        record: the question.
        pool: the split's document pool.
        tokenizer: counts tokens (required with ``target_tokens``; optional otherwise).
        seed: base seed; the sample's RNG comes from ``(seed, record.id)``.
        num_docs: total documents (exactly one of ``num_docs`` / ``target_tokens``).
        target_tokens: most context tokens.
        allow_reuse: draw distractors more than once when the pool is too small.

    Returns:
        A Sample whose metadata holds ``task, num_docs, length_tokens, tokenizer, seed, own_positions``
        (1-based numbers of the question's own paragraphs), ``gold_positions`` (the supporting ones) and
        ``evidence`` (the supporting paragraphs' spans, see :meth:`DocumentContext.evidence`).

    Raises:
        DataError: bad size arguments, or the pool is too small.
    """
    if (num_docs is None) == (target_tokens is None):
        raise DataError("give exactly one of num_docs or target_tokens")
    rng = sample_rng(seed, f"hotpotqa/{record.id}")
    own = list(dict.fromkeys(record.documents))
    if num_docs is not None:
        ctx = draw_documents(own, pool, num_docs, rng, tokenizer, allow_reuse=allow_reuse)
    else:
        if tokenizer is None:
            raise DataError("target_tokens needs a tokenizer to count tokens")
        ctx = fit_documents(own, pool, target_tokens, rng, tokenizer)
    titles = [d.split("\n", 1)[0] for d in own]
    gold = sorted(p for p, t in zip(ctx.own_positions, titles) if t in record.gold_titles)
    supporting = [d for d, t in zip(own, titles) if t in record.gold_titles]
    meta: dict[str, Any] = {
        "task": "hotpotqa",
        "source": f"{pool.name}:{record.id}",
        "num_docs": len(ctx.docs),
        "length_tokens": ctx.length_tokens,
        "tokenizer": tokenizer.name if tokenizer is not None else None,
        "seed": seed,
        "own_positions": list(ctx.own_positions),
        "gold_positions": gold,
        "evidence": ctx.evidence(supporting, "supporting_paragraph"),
    }
    if target_tokens is not None:
        meta["target_tokens"] = target_tokens
    if ctx.reused:
        meta["reused_distractors"] = ctx.reused
    return Sample(f"hotpotqa-{record.id}", record.question, ctx.context, (record.answer,), meta)


def select_records(records: Sequence[HotpotRecord], num_samples: int, start: int = 0,
                   keep_incomplete: bool = False) -> list[HotpotRecord]:
    """The first ``num_samples`` usable records from position ``start``.

    A record is usable when it has at least two paragraphs (the dev file has a few questions without context)
    and, unless ``keep_incomplete``, every supporting paragraph is among them (:attr:`HotpotRecord.missing_gold`
    is empty). Skipping incomplete records is our fix: the reference's data builder does not check, which is
    harmless on the official file but not on copies that lost gold paragraphs.

    Raises:
        DataError: fewer usable records than asked for (says how many were skipped for missing gold paragraphs).
    """
    usable, incomplete = [], 0
    for r in records[start:]:
        if len(r.paragraphs) < 2:
            continue
        if r.missing_gold and not keep_incomplete:
            incomplete += 1
            continue
        usable.append(r)
        if len(usable) == num_samples:
            return usable
    skipped = (f"; {incomplete} more lack a supporting paragraph in their context (keep them with "
               "--keep-incomplete)") if incomplete else ""
    raise DataError(f"only {len(usable)} usable HotpotQA records from position {start}, asked for {num_samples}{skipped}")


def _check_sizes(num_docs: Sequence[int], target_tokens: Sequence[int], allow_reuse: bool, reference_format: bool) -> None:
    """Refuse a :func:`build_hotpotqa` call without sizes, or with options that apply to document counts only."""
    if not num_docs and not target_tokens:
        raise DataError("give at least one size: --docs N,... or --tokens T,...")
    if target_tokens and allow_reuse:
        raise DataError("--allow-reuse applies to --docs sizes only; a --tokens size must fit the pool as it is "
                        "(use a shorter length or a larger pool)")
    if target_tokens and reference_format:
        raise DataError("--reference-format writes the reference's eval_{N}.json, which is sized in documents: "
                        "use it with --docs, not --tokens")


def build_hotpotqa(
    out_dir: str | os.PathLike,
    tokenizer: Tokenizer,
    num_docs: Sequence[int] = (),
    target_tokens: Sequence[int] = (),
    num_samples: int = 128,
    seed: int = 0,
    split: str = "dev",
    data_root: str | os.PathLike | None = None,
    allow_reuse: bool = False,
    start: int = 0,
    reference_format: bool = False,
    keep_incomplete: bool = False,
) -> list[Path]:
    """Build RULER-HotpotQA files, one per size, plus a manifest each.

    Writes ``hotpotqa_{N}docs.jsonl`` (or ``hotpotqa_{T}tok.jsonl``) in our schema and, with
    ``reference_format``, the reference's ``eval_{N}.json`` layout too (document counts only: the reference has
    no token-sized files). Questions come from :func:`select_records` (``start``, ``keep_incomplete``).

    Returns:
        The sample files written.

    Raises:
        DataError: no sizes, missing data, pool too small, too few usable questions; ``allow_reuse`` or
            ``reference_format`` with token sizes.
    """
    _check_sizes(num_docs, target_tokens, allow_reuse, reference_format)
    src = paths.data_file(paths.HOTPOTQA_DEV if split == "dev" else paths.HOTPOTQA_TRAIN, data_root)
    records = load_hotpotqa(src)
    pool = build_pool(records, name=f"hotpotqa-{split}")
    chosen = select_records(records, num_samples, start, keep_incomplete)
    built = []  # every size is built before any file is written: a size that cannot be built leaves no partial output
    for kind, size in [("docs", n) for n in num_docs] + [("tok", t) for t in target_tokens]:
        kw = {"num_docs": size} if kind == "docs" else {"target_tokens": size}
        flag = f"--docs {size}" if kind == "docs" else f"--tokens {size}"
        samples = build_all(chosen, lambda r: build_sample(r, pool, tokenizer, seed, allow_reuse=allow_reuse, **kw),
                            lambda r: f"question {r.id}", flag)
        built.append((kind, size, samples))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for kind, size, samples in built:
        path = out / f"hotpotqa_{size}{kind}.jsonl"
        write_samples(path, samples)
        written.append(path)
        if reference_format and kind == "docs":
            rows = [
                {"context": s.context, "input": s.question, "answers": list(s.answers), "num_docs": size,
                 "index": int(r.id) if r.id.isdigit() else r.id}  # the reference's int: the dev index
                for s, r in zip(samples, chosen)
            ]
            write_records(out / f"eval_{size}.json", rows)
        lengths = [s.metadata["length_tokens"] for s in samples]
        write_manifest(
            path.with_suffix(".manifest.json"),
            {
                "task": "hotpotqa",
                "split": split,
                "source_file": str(src),
                "pool": pool.name,
                "pool_size": len(pool),
                "seed": seed,
                "tokenizer": tokenizer.name,
                ("num_docs" if kind == "docs" else "target_tokens"): size,
                "num_samples": len(samples),
                "record_ids": [r.id for r in chosen],
                "allow_reuse": allow_reuse,
                "keep_incomplete": keep_incomplete,
                "length_tokens": token_stats(lengths),
            },
        )
    return written


def demo_sample(
    data_root: str | os.PathLike | None,
    tokenizer: Tokenizer,
    target_tokens: int = 30000,
    seed: int = 0,
    index: int = 0,
) -> Sample:
    """A real HotpotQA dev question with its paragraphs hidden among distractors, about ``target_tokens`` long.

    Args:
        data_root: data root (``None``: the default, see :func:`memagent.data.paths.data_root`).
        tokenizer: the model's tokenizer (sizes are in its tokens).
        target_tokens: most context tokens; the result is within ~1% below it.
        seed: base seed of the distractor draw.
        index: which usable dev question (0 = the first in dev order; see :func:`select_records`).

    Raises:
        DataError: no data root / file, or ``index`` out of range.
    """
    records = load_hotpotqa(paths.data_file(paths.HOTPOTQA_DEV, data_root))
    usable = [r for r in records if len(r.paragraphs) >= 2 and not r.missing_gold]
    if not 0 <= index < len(usable):
        raise DataError(f"demo index {index} out of range: the dev subset has {len(usable)} usable questions")
    pool = build_pool(records, name="hotpotqa-dev")
    return build_sample(usable[index], pool, tokenizer, seed, target_tokens=target_tokens)
