"""Pure chunking: a document's tokens -> consecutive chunks whose texts join back to the document exactly.

Source: the reference splits the tokenized context into non-overlapping slices ``[i*C, (i+1)*C)`` of
``C = chunk_size`` tokens, the last one shorter (reference doc section 1.2). It decodes each slice back to
text, which can break a multi-byte character at a boundary; memagent instead cuts the original text at the
character offsets of the token boundaries, so no character is lost, duplicated or mangled.
"""

from __future__ import annotations

from collections.abc import Sequence

from memagent.errors import ConfigError
from memagent.tokenization import Tokenizer
from memagent.types import Chunk


def chunk_offsets(text: str, ids: Sequence[int], boundaries: Sequence[int], chunk_tokens: int) -> list[Chunk]:
    """Split already-tokenized text into chunks of ``chunk_tokens`` tokens.

    Args:
        text: the document.
        ids: its token ids, shape ``(T,)``.
        boundaries: character boundaries, shape ``(T + 1,)`` (see :class:`memagent.tokenization.Tokenizer`).
        chunk_tokens: tokens per chunk (> 0); the last chunk holds the remainder.

    Returns:
        ``ceil(T / chunk_tokens)`` chunks (none for an empty document).

    Raises:
        ConfigError: ``chunk_tokens`` < 1 or ``boundaries`` does not fit ``ids``.
    """
    if chunk_tokens < 1:
        raise ConfigError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    n = len(ids)
    if len(boundaries) != n + 1:
        raise ConfigError(f"expected {n + 1} boundaries for {n} tokens, got {len(boundaries)}")
    chunks = []
    for i, start in enumerate(range(0, n, chunk_tokens)):
        end = min(start + chunk_tokens, n)
        c0 = boundaries[start] if start else 0
        c1 = boundaries[end] if end < n else len(text)
        chunks.append(Chunk(i, start, end, c0, c1, text[c0:c1]))
    return chunks


def chunk_text(text: str, tokenizer: Tokenizer, chunk_tokens: int) -> list[Chunk]:
    """Tokenize ``text`` and split it into chunks of ``chunk_tokens`` model tokens (see :func:`chunk_offsets`)."""
    ids, bounds = tokenizer.encode_with_offsets(text)
    return chunk_offsets(text, ids, bounds, chunk_tokens)


def center_truncate_ranges(text: str, tokenizer: Tokenizer, max_tokens: int | None) -> tuple[tuple[tuple[int, int], ...], int]:
    """The character ranges of ``text`` that center truncation keeps (see :func:`center_truncate`).

    Returns:
        ``(ranges, num_tokens)``: ``((0, len(text)),)`` when nothing is cut, else ``((0, head_end), (tail_start,
        len(text)))``; and the original-token count after cutting.

    Raises:
        ConfigError: ``max_tokens`` < 2.
    """
    ids, bounds = tokenizer.encode_with_offsets(text)
    n = len(ids)
    if max_tokens is None or n <= max_tokens:
        return ((0, len(text)),), n
    if max_tokens < 2:
        raise ConfigError(f"max_context_tokens must be >= 2 to keep a head and a tail, got {max_tokens}")
    tail = max_tokens // 2
    head = max_tokens - tail
    return ((0, bounds[head]), (bounds[n - tail], len(text))), max_tokens


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

    Source: reference doc section 1.7 (first half + last half of the token sequence).
    """
    ranges, n = center_truncate_ranges(text, tokenizer, max_tokens)
    return "".join(text[a:b] for a, b in ranges), n


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
