"""Document pools and multi-document contexts: RULER-HotpotQA and RULER's qa tasks share this code.

A context is the question's own paragraphs hidden among distractor paragraphs from a pool, shuffled and
rendered as ``Document i:\\n<text>`` blocks (:func:`memagent.data.schema.render_documents`). Either the number of
documents is fixed (:func:`draw_documents`) or documents are added until a token budget is reached
(:func:`fit_documents`).

Randomness: every sample has its own RNG derived from ``(seed, sample key)`` (:func:`sample_rng`). The reference
reseeds one shuffle with the same constant for every sample, so the gold paragraphs sit in the same slots for
every question of a given size, and its forked workers share one RNG state (reference doc section 6, item 6).
"""

from __future__ import annotations

import hashlib
import random
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from memagent.data.schema import document_spans, evidence_item, render_documents
from memagent.errors import DataError
from memagent.tokenization import Tokenizer, count_tokens


def sample_rng(seed: int, key: str) -> random.Random:
    """An RNG that depends only on ``(seed, key)``: the same pair always gives the same stream, different
    keys give independent streams (SHA-256 of ``"<seed>/<key>"``)."""
    digest = hashlib.sha256(f"{seed}/{key}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


@dataclass(frozen=True)
class DocumentPool:
    """The sorted list of unique paragraphs of a split.

    Attributes:
        docs: unique paragraph texts, sorted (so indices do not depend on file order).
        name: where the pool came from (recorded in manifests).
    """

    docs: tuple[str, ...]
    name: str = ""
    _index: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    _near: dict[str, tuple[int, ...]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_texts(cls, texts: Iterable[str], name: str = "") -> DocumentPool:
        docs = tuple(sorted(set(texts)))
        pool = cls(docs, name)
        pool._index.update({d: i for i, d in enumerate(docs)})
        return pool

    def __len__(self) -> int:
        return len(self.docs)

    def index_of(self, doc: str) -> int | None:
        return self._index.get(doc)

    def near_duplicates(self, texts: Iterable[str]) -> set[int]:
        """Indices of the paragraphs equal to one of ``texts`` up to Unicode compatibility forms and whitespace
        (:func:`near_key`): the HotpotQA dev pool holds pairs that differ only by a no-break space (U+00A0), so
        an exact-text check let a question's own paragraph come back as a distractor at thousands of
        documents."""
        if not self._near and self.docs:
            groups: dict[str, list[int]] = {}
            for i, d in enumerate(self.docs):
                groups.setdefault(near_key(d), []).append(i)
            self._near.update({k: tuple(v) for k, v in groups.items()})
        return {i for t in texts for i in self._near.get(near_key(t), ())}


def near_key(text: str) -> str:
    """``text`` in Unicode NFKC with every run of whitespace one space, stripped: two paragraphs with one key
    are one paragraph to a reader."""
    return " ".join(unicodedata.normalize("NFKC", text).split())


@dataclass(frozen=True)
class DocumentContext:
    """A rendered multi-document context.

    Attributes:
        docs: the documents in rendered order.
        own_positions: 1-based document numbers of the question's own paragraphs, in the order given.
        context: the rendered text.
        length_tokens: tokens of ``context`` (``-1`` when no tokenizer was given).
        reused: number of distractors drawn more than once (only with ``allow_reuse``).
    """

    docs: tuple[str, ...]
    own_positions: tuple[int, ...]
    context: str
    length_tokens: int
    reused: int = 0

    def evidence(self, gold: Sequence[str], kind: str) -> list[dict]:
        """``metadata["evidence"]`` entries for the documents among ``gold``, in context order: each document's
        text span (its ``Document i:`` header excluded) and its 1-based number ``document``."""
        wanted = set(gold)
        spans = document_spans(self.docs)
        return [evidence_item(self.context, a, b, kind, document=i + 1)
                for i, (d, (a, b)) in enumerate(zip(self.docs, spans)) if d in wanted]


def _distractor_order(pool: DocumentPool, exclude: set[str], rng: random.Random) -> list[int]:
    """The pool's paragraphs other than ``exclude``, in the sample's random order. Near-duplicates of an
    excluded paragraph (:meth:`DocumentPool.near_duplicates`) are dropped after the shuffle, so every other
    sample's draws stay as they were."""
    order = [i for i, d in enumerate(pool.docs) if d not in exclude]
    rng.shuffle(order)
    near = pool.near_duplicates(exclude)
    return [i for i in order if i not in near] if near else order


def _shuffle_with_own(own: Sequence[str], others: Sequence[str], rng: random.Random) -> tuple[list[str], tuple[int, ...]]:
    tagged = [(d, k) for k, d in enumerate(own)] + [(d, -1) for d in others]
    rng.shuffle(tagged)
    pos = {k: i + 1 for i, (_, k) in enumerate(tagged) if k >= 0}
    return [d for d, _ in tagged], tuple(pos[k] for k in range(len(own)))


def draw_documents(
    own: Sequence[str],
    pool: DocumentPool,
    num_docs: int,
    rng: random.Random,
    tokenizer: Tokenizer | None = None,
    allow_reuse: bool = False,
    more: Sequence[str] = (),
) -> DocumentContext:
    """The question's own documents plus distractors up to ``num_docs`` documents, shuffled.

    Args:
        own: the question's own paragraphs (always kept).
        pool: the distractor pool (own paragraphs are never drawn again).
        num_docs: total number of documents.
        rng: the sample's RNG (see :func:`sample_rng`).
        tokenizer: counts the rendered context's tokens when given.
        allow_reuse: when the pool has too few other paragraphs, draw some distractors more than once
            instead of failing.
        more: preferred distractors taken before random ones (e.g. same-article paragraphs).

    Raises:
        DataError: ``num_docs`` < number of own docs, or the pool is too small and reuse is not allowed.

    Source: reference doc section 3.2 (own 10 paragraphs + uniform draws without replacement).
    """
    own = list(dict.fromkeys(own))
    need = num_docs - len(own)
    if need < 0:
        raise DataError(f"num_docs={num_docs} is smaller than the question's {len(own)} own paragraphs")
    extra = [d for d in dict.fromkeys(more) if d not in set(own)][:need]
    exclude = set(own) | set(extra)
    order = _distractor_order(pool, exclude, rng)
    rest = need - len(extra)
    reused = 0
    if rest > len(order):
        if not allow_reuse or not order:
            raise DataError(
                f"the pool {pool.name!r} has only {len(order)} paragraphs besides this question's own, but "
                f"{num_docs} documents need {rest} distractors: use fewer documents or allow reuse (--allow-reuse)"
            )
        reused = rest - len(order)
        order = order + [rng.choice(order) for _ in range(reused)]
    others = extra + [pool.docs[i] for i in order[:rest]]
    docs, positions = _shuffle_with_own(own, others, rng)
    context = render_documents(docs)
    n = count_tokens(tokenizer, context) if tokenizer is not None else -1
    return DocumentContext(tuple(docs), positions, context, n, reused)


#: Candidates passed over in a row (each too long for the room left) before :func:`fit_documents` stops adding.
FIT_LOOKAHEAD = 32


def _add_candidates(candidates, nxt, est, target, doc_cost, chosen, docs, rng) -> tuple[int, int, int, int]:
    """Add candidates from position ``nxt`` while they fit the estimate (each at a random position of ``docs``),
    passing over up to ``FIT_LOOKAHEAD`` in a row that are too long. Returns ``(nxt, est, added, misses)``."""
    added = misses = 0
    while nxt < len(candidates) and misses < FIT_LOOKAHEAD:
        d = candidates[nxt]
        nxt += 1
        if est + doc_cost(d) > target:
            misses += 1  # too long for the room left: try the next ones
            continue
        est += doc_cost(d)
        chosen.append(d)
        docs.insert(rng.randint(0, len(docs)), d)
        added += 1
        misses = 0
    return nxt, est, added, misses


def _remove_last_added(chosen, docs, excess, doc_cost) -> int:
    """Remove distractors, last added first, until their estimated tokens cover ``excess``; returns those tokens."""
    removed = 0
    while removed < excess and chosen:
        d = chosen.pop()
        docs.remove(d)
        removed += doc_cost(d)
    return removed


def fit_documents(
    own: Sequence[str],
    pool: DocumentPool,
    budget_tokens: int,
    rng: random.Random,
    tokenizer: Tokenizer,
    more: Sequence[str] = (),
    fixed_tokens: int = 0,
    tolerance_tokens: int | None = None,
) -> DocumentContext:
    """Own documents plus as many distractors as fit in ``budget_tokens`` (rendered context + ``fixed_tokens``).

    Distractors are added in a random order (``more`` first), each costing its own token count plus a
    per-document overhead for the ``Document i:`` header; a candidate too long for the room left is passed
    over for the next ones (up to ``FIT_LOOKAHEAD`` in a row), so a long paragraph does not end the filling
    early. The documents are shuffled and the rendered text counted exactly; distractors are then removed (last
    added first) or added until the exact count is at most the budget and within ``tolerance_tokens`` of it,
    or no further candidate fits. Each document is tokenized once on its own; the whole context only a few
    times, never once per added document.

    Args:
        own: the question's own paragraphs.
        pool: the distractor pool.
        budget_tokens: most tokens allowed for the context plus ``fixed_tokens``.
        rng: the sample's RNG.
        tokenizer: the model's tokenizer.
        more: preferred distractors (taken first, in order).
        fixed_tokens: tokens of text around the context that share the budget (question, template).
        tolerance_tokens: stop when at most this far below the budget (default: ~1% of the budget, at least 50).

    Raises:
        DataError: the own documents alone do not fit, or the pool runs out before the budget is reached.
    """
    own = list(dict.fromkeys(own))
    tol = tolerance_tokens if tolerance_tokens is not None else max(50, budget_tokens // 100)
    target = budget_tokens - fixed_tokens
    header = count_tokens(tokenizer, "Document 100:\n") + count_tokens(tokenizer, "\n\n")
    cost = {}

    def doc_cost(d: str) -> int:
        if d not in cost:
            cost[d] = count_tokens(tokenizer, d) + header
        return cost[d]

    extra = [d for d in dict.fromkeys(more) if d not in set(own)]
    candidates = extra + [pool.docs[i] for i in _distractor_order(pool, set(own) | set(extra), rng)]
    chosen: list[str] = []
    est = sum(doc_cost(d) for d in own)
    if est - header > target + tol:
        raise _too_short(f"~{est}", target, fixed_tokens)
    nxt = 0
    docs, _ = _shuffle_with_own(own, [], rng)
    shrinking = False
    for _ in range(16):
        added = misses = 0
        if not shrinking:
            nxt, est, added, misses = _add_candidates(candidates, nxt, est, target, doc_cost, chosen, docs, rng)
        context = render_documents(docs)
        exact = count_tokens(tokenizer, context)
        if exact > target:
            excess = exact - target
            removed = _remove_last_added(chosen, docs, excess, doc_cost)
            if removed < excess:
                raise _too_short(str(exact - removed), target, fixed_tokens)
            shrinking = True  # from now on only remove, so the loop cannot oscillate
            continue
        exhausted = nxt >= len(candidates)
        if exhausted and not shrinking and not misses and target - exact > tol:
            raise DataError(
                f"the pool {pool.name!r} ({len(pool)} paragraphs) runs out at {exact} tokens, short of the "
                f"{target}-token target: use a shorter length or a larger pool"
            )
        full = exhausted or added == 0  # no further candidate fits what is left
        if shrinking or full or target - exact <= tol:
            where = {d: k for k, d in enumerate(own)}
            pos = {where[d]: i + 1 for i, d in enumerate(docs) if d in where}
            return DocumentContext(tuple(docs), tuple(pos[k] for k in range(len(own))), context, exact)
        est = exact  # calibrate the estimate on the exact count, then add more
    raise DataError(f"could not fit documents to {budget_tokens} tokens (tokenizer {tokenizer.name!r})")


class LengthTooShort(DataError):
    """A target length below what one question's own documents take.

    Attributes:
        short: tokens the target length lacks for this question (estimated when the message says ``~``).
    """

    def __init__(self, message: str, short: int):
        super().__init__(message)
        self.short = short


def _too_short(own_tokens: str, target: int, fixed_tokens: int) -> LengthTooShort:
    """The error for a target length below what the question's own documents take (``own_tokens``: a count,
    ``~``-prefixed when estimated; ``target``: the tokens left for documents after the ``fixed_tokens`` of the
    prompt around them)."""
    short = int(own_tokens.lstrip("~")) - target
    return LengthTooShort(f"the question's own documents alone take {own_tokens} tokens, over the {target} tokens "
                          f"left for documents (the prompt around them takes {fixed_tokens}): give a target length "
                          f"at least {short} tokens longer", short)


def build_all(items: Sequence, build, name, flag: str) -> list:
    """``[build(x) for x in items]``, where a :class:`LengthTooShort` does not stop at the first question: every
    item is tried, and the error names how many do not fit and the length that fits them all.

    Args:
        items: what to build from (questions, sample indices).
        build: one item -> one sample.
        name: one item -> how to name it in a message (``question 13``).
        flag: the size as the user gave it (``--tokens 2048``).

    Raises:
        DataError: the first other error (naming the item), or the shortfalls of all items.
    """
    out, short = [], []
    for x in items:
        try:
            out.append(build(x))
        except LengthTooShort as e:
            short.append((e.short, name(x), str(e)))
        except DataError as e:
            raise DataError(f"{name(x)} at {flag}: {e}") from None
    if len(short) == 1:
        raise DataError(f"{short[0][1]} at {flag}: {short[0][2]}")
    if short:
        most = max(short, key=lambda x: x[0])
        raise DataError(f"{len(short)} of {len(items)} do not fit at {flag}; the one that needs most, {most[1]}: "
                        f"{most[2]}")
    return out
