"""Pure chunking: a document's tokens -> consecutive chunks whose texts join back to the document exactly.

Source: the reference splits the tokenized context into non-overlapping slices ``[i*C, (i+1)*C)`` of
``C = chunk_size`` tokens, the last one shorter (reference doc section 1.2). It decodes each slice back to
text, which can break a multi-byte character at a boundary; memagent instead cuts the original text at the
character offsets of the token boundaries, so no character is lost, duplicated or mangled, and no chunk is
empty (a character longer than a chunk stays whole in the chunk where it starts, see :func:`chunk_offsets`).
"""

from __future__ import annotations

from collections.abc import Sequence

from memagent.errors import ConfigError, DataError
from memagent.tokenization import Tokenizer, lone_surrogate
from memagent.types import Chunk


def chunk_offsets(text: str, ids: Sequence[int], boundaries: Sequence[int], chunk_tokens: int) -> list[Chunk]:
    """Split already-tokenized text into chunks of ``chunk_tokens`` tokens.

    A chunk is never empty. The slice ``[i*C, (i+1)*C)`` of ``C = chunk_tokens`` tokens is cut at character
    boundaries, and a character belongs to the token in which it starts; a slice in which no character starts
    (all its tokens are later bytes of a character begun in the slice before: a CJK character is 3 UTF-8
    bytes, so 3 byte-level tokens, and cannot fit in a chunk of 1 or 2) is joined to the chunk before it. So a
    character longer than a chunk stays whole in the chunk where it starts, that chunk holds more than
    ``chunk_tokens`` tokens (at most ``chunk_tokens + 3`` for a byte-level tokenizer, whose characters are at
    most 4 tokens), and the next chunk starts with the next character. A slice of zero-width tokens at the
    very start joins the chunk after it.

    Args:
        text: the document.
        ids: its token ids, shape ``(T,)``.
        boundaries: character boundaries, shape ``(T + 1,)`` (see :class:`memagent.tokenization.Tokenizer`).
        chunk_tokens: tokens per chunk (> 0); the last chunk holds the remainder.

    Returns:
        ``ceil(T / chunk_tokens)`` chunks (fewer when slices were joined as above; none for an empty
        document), whose texts join to ``text`` and whose token ranges join to ``[0, T)``.

    Raises:
        ConfigError: ``chunk_tokens`` < 1 or ``boundaries`` does not fit ``ids``.
    """
    if chunk_tokens < 1:
        raise ConfigError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    n = len(ids)
    if len(boundaries) != n + 1:
        raise ConfigError(f"expected {n + 1} boundaries for {n} tokens, got {len(boundaries)}")
    spans: list[list[int]] = []  # [start_token, end_token, start_char, end_char]
    for start in range(0, n, chunk_tokens):
        end = min(start + chunk_tokens, n)
        c0 = boundaries[start] if start else 0
        c1 = boundaries[end] if end < n else len(text)
        if spans and spans[-1][2] == spans[-1][3]:  # zero-width tokens at the start: join the next slice
            spans[-1][1], spans[-1][3] = end, c1
        elif spans and c0 == c1:  # no character starts in this slice: its tokens end the previous chunk's
            spans[-1][1] = end
        else:
            spans.append([start, end, c0, c1])
    return [Chunk(i, t0, t1, c0, c1, text[c0:c1]) for i, (t0, t1, c0, c1) in enumerate(spans)]


def chunk_text(text: str, tokenizer: Tokenizer, chunk_tokens: int) -> list[Chunk]:
    """Tokenize ``text`` and split it into chunks of ``chunk_tokens`` model tokens (see :func:`chunk_offsets`).

    Raises:
        DataError: the text holds a lone surrogate code point, which no tokenizer can encode.
        ConfigError: as :func:`chunk_offsets`.
    """
    _check_encodable(text)
    ids, bounds = tokenizer.encode_with_offsets(text)
    return chunk_offsets(text, ids, bounds, chunk_tokens)


def center_truncate_ranges(text: str, tokenizer: Tokenizer, max_tokens: int | None) -> tuple[tuple[tuple[int, int], ...], int]:
    """The character ranges of ``text`` that center truncation keeps (see :func:`center_truncate`).

    Returns:
        ``(ranges, num_tokens)``: ``((0, len(text)),)`` when nothing is cut, else ``((0, head_end), (tail_start,
        len(text)))``; and the original-token count after cutting.

    Raises:
        ConfigError: ``max_tokens`` < 2.
        DataError: the text holds a lone surrogate code point.
    """
    _check_encodable(text)
    _, bounds = tokenizer.encode_with_offsets(text)
    return _kept_ranges(bounds, len(text), max_tokens)


def _kept_ranges(bounds: Sequence[int], text_chars: int, max_tokens: int | None) -> tuple[tuple[tuple[int, int], ...], int]:
    """:func:`center_truncate_ranges` from the token boundaries (shape ``(T + 1,)``) of a text of ``text_chars``."""
    n = len(bounds) - 1
    if max_tokens is None or n <= max_tokens:
        return ((0, text_chars),), n
    if max_tokens < 2:
        raise ConfigError(f"max_context_tokens must be >= 2 to keep a head and a tail, got {max_tokens}")
    tail = max_tokens // 2
    head = max_tokens - tail
    return ((0, bounds[head]), (bounds[n - tail], text_chars)), max_tokens


def center_truncate(text: str, tokenizer: Tokenizer, max_tokens: int | None) -> tuple[str, int]:
    """Keep the first and last ``max_tokens // 2`` tokens of ``text`` (reference "center truncation").

    The head keeps ``max_tokens - max_tokens // 2`` tokens, so an odd budget is used in full. Cuts are made
    at character boundaries of the tokens, so the result is a prefix plus a suffix of ``text``
    (:func:`center_truncate_ranges` gives their ranges).

    Args:
        text: the document.
        tokenizer: the model's tokenizer.
        max_tokens: budget in tokens; ``None`` disables truncation.

    Returns:
        ``(text, num_tokens)``: the possibly shortened text and its original-token count after cutting.

    Raises:
        ConfigError: ``max_tokens`` < 2.
        DataError: the text holds a lone surrogate code point.

    Source: reference doc section 1.7 (first half + last half of the token sequence).
    """
    ranges, n = center_truncate_ranges(text, tokenizer, max_tokens)
    return "".join(text[a:b] for a, b in ranges), n


def chunk_document(text: str, tokenizer: Tokenizer, chunk_tokens: int,
                   max_tokens: int | None = None) -> tuple[list[Chunk], int, tuple[tuple[int, int], ...]]:
    """Center-truncate ``text`` to ``max_tokens`` and split it into chunks, tokenizing it once.

    The kept head and tail keep the token ids and boundaries of the whole document (not a re-tokenisation of
    the shortened text, which could merge differently where the two halves meet), so the chunks hold exactly
    ``min(T, max_tokens)`` tokens and their texts join to the shortened text.

    Args:
        text: the document.
        tokenizer: the model's tokenizer.
        chunk_tokens: tokens per chunk (> 0).
        max_tokens: center truncation budget in tokens (see :func:`center_truncate`); ``None`` keeps all.

    Returns:
        ``(chunks, document_tokens, kept)``: the chunks of the (possibly shortened) document, its length in
        tokens, and the ranges of ``text`` it is made of (:func:`center_truncate_ranges`; map a chunk's
        characters back with :func:`source_ranges`).

    Raises:
        ConfigError: ``chunk_tokens`` < 1 or ``max_tokens`` < 2.
        DataError: the text holds a lone surrogate code point, which no tokenizer can encode.
    """
    _check_encodable(text)
    ids, bounds = tokenizer.encode_with_offsets(text)
    kept, n_kept = _kept_ranges(bounds, len(text), max_tokens)
    if len(kept) == 1:
        return chunk_offsets(text, ids, bounds, chunk_tokens), n_kept, kept
    n, tail = len(ids), max_tokens // 2
    head = max_tokens - tail
    cut, resume = kept[0][1], kept[1][0]
    short = text[:cut] + text[resume:]
    shift = resume - cut
    short_bounds = list(bounds[: head + 1]) + [b - shift for b in bounds[n - tail + 1 :]]
    short_bounds[-1] = len(short)
    return chunk_offsets(short, list(ids[:head]) + list(ids[n - tail :]), short_bounds, chunk_tokens), n_kept, kept


def source_ranges(kept: Sequence[tuple[int, int]], start: int, end: int) -> tuple[tuple[int, int], ...]:
    """Map ``[start, end)`` of a truncated text back to the original text.

    Args:
        kept: the ranges of the original text that the truncated text is made of, in order (as returned by
            :func:`center_truncate_ranges`).
        start, end: a character range of the truncated text.

    Returns:
        The ranges of the original text it covers (two where it spans a cut; none for an empty range).
    """
    out, offset = [], 0
    for a, b in kept:
        lo, hi = max(start, offset), min(end, offset + b - a)
        if lo < hi:
            out.append((a + lo - offset, a + hi - offset))
        offset += b - a
    return tuple(out)


def _check_encodable(text: str) -> None:
    if (at := lone_surrogate(text)) is not None:
        raise DataError(f"the text holds a lone surrogate U+{ord(text[at]):04X} at character {at}, which no tokenizer "
                        "can encode; remove it")
