"""Pure chunking: a document's tokens -> consecutive chunks whose texts join back to the document exactly.

Source: the reference splits the tokenized context into non-overlapping slices ``[i*C, (i+1)*C)`` of
``C = chunk_size`` tokens, the last one shorter (reference doc section 1.2). It decodes each slice back to
text, which can break a multi-byte character at a boundary; memagent instead cuts the original text at the
character offsets of the token boundaries, so no character is lost, duplicated or mangled, and no chunk is
empty (a character longer than a chunk stays whole in the chunk where it starts, see :func:`chunk_offsets`).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Sequence

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import numpy as np

from memagent.errors import ConfigError, DataError
from memagent.stitching import DEFAULT_BLOCK_CHARS, TokenBlock, string_pieces, token_blocks
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
    return kept_ranges(bounds, len(text), max_tokens)


def kept_ranges(bounds: Sequence[int], text_chars: int, max_tokens: int | None) -> tuple[tuple[tuple[int, int], ...], int]:
    """:func:`center_truncate_ranges` from the token boundaries (shape ``(T + 1,)``, see
    :class:`memagent.tokenization.Tokenizer`) of a text of ``text_chars`` characters: the head keeps at most
    ``max_tokens - max_tokens // 2`` tokens and the tail at most ``max_tokens // 2``, each cut at a character
    boundary, and the count returned is the tokens kept (fewer than ``max_tokens`` where a multi-byte character
    would straddle a cut)."""
    n = len(bounds) - 1
    if max_tokens is None or n <= max_tokens:
        return ((0, text_chars),), n
    if max_tokens < 2:
        raise ConfigError(f"max_context_tokens must be >= 2 to keep a head and a tail, got {max_tokens}")
    tail = max_tokens // 2
    head = max_tokens - tail
    # A token inside a character (a byte of a multi-byte character) has the character's end as its boundary, so
    # the character offset bounds[k] may keep more than k tokens: the tokens before offset c are those up to the
    # last index whose boundary is c. Cut the head at the last offset that keeps at most `head` tokens and read
    # the tail from its offset, and count what is kept.
    c, kept_head = _head_cut(bounds, head)
    t = bounds[n - tail]
    kept_tail = n - (bisect.bisect_right(bounds, t) - 1)
    return ((0, int(c)), (int(t), text_chars)), int(kept_head + kept_tail)


def _head_cut(bounds: Sequence[int], head: int) -> tuple[int, int]:
    """``(char, tokens)``: where a head of at most ``head`` tokens ends, at a character boundary, and the tokens it
    keeps (fewer than ``head`` where a multi-byte character would straddle the cut; see :func:`kept_ranges`)."""
    c = int(bounds[head])
    kept = bisect.bisect_right(bounds, c) - 1
    if kept > head:
        i = bisect.bisect_left(bounds, c) - 1
        c, kept = (int(bounds[i]), bisect.bisect_right(bounds, bounds[i]) - 1) if i >= 0 else (0, 0)
    return c, kept


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
    the shortened text, which could merge differently where the two halves meet), so the chunks hold the
    tokens :func:`center_truncate_ranges` counts (``min(T, max_tokens)``, less where a multi-byte character
    straddles a cut and is left out) and their texts join to the shortened text. The chunks of
    :class:`ChunkStream`, gathered in a list.

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
    stream = ChunkStream(text, tokenizer, chunk_tokens, max_tokens)
    chunks = list(stream)
    return chunks, stream.document_tokens, stream.kept


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


@runtime_checkable
class TextSource(Protocol):
    """A document read in pieces (a file, a stream, an iterator of text; see :mod:`memagent.data.io`).

    ``pieces()`` yields the text from its start in pieces of any size; it is called once. ``name`` names
    the source in messages. A source that knows it holds whitespace only (a short file or stream) may say so with
    an attribute ``blank = True``: the agent then reads it as empty, as it does a blank string.
    """

    name: str

    def pieces(self) -> Iterable[str]: ...


class ChunkStream:
    """The chunks of a document, made as they are read: a document of any length in bounded memory.

    Iterating yields the same chunks as :func:`chunk_offsets` over the whole (center-truncated) document
    (see :mod:`memagent.stitching` for the one exception), while holding only the block being tokenized and
    the text of the chunk being cut. With ``max_tokens`` a first pass counts the tokens (and records where
    each block starts), and the second reads the head, skips the middle untokenized, and reads the tail.

    Args:
        source: the document: a string, or a :class:`TextSource`.
        tokenizer: the model's tokenizer.
        chunk_tokens: tokens per chunk (> 0).
        max_tokens: center truncation budget in tokens; ``None`` reads everything.
        block_chars: characters per tokenizer call (default: ``8 * chunk_tokens``, within 4096 and
            :data:`memagent.stitching.DEFAULT_BLOCK_CHARS`).

    Attributes:
        document_tokens: tokens of the document read (after truncation); known once the chunks are all
            read, or from the start with ``max_tokens``.
        kept: the ranges of the source's text that are read (:func:`center_truncate_ranges`); known as
            ``document_tokens`` is.

    Raises:
        ConfigError: ``chunk_tokens`` < 1 or ``max_tokens`` < 2 (at construction).
        DataError: the text holds a lone surrogate (while reading), or the source cannot be read.
    """

    def __init__(self, source: str | TextSource, tokenizer: Tokenizer, chunk_tokens: int,
                 max_tokens: int | None = None, block_chars: int | None = None):
        if chunk_tokens < 1:
            raise ConfigError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if max_tokens is not None and max_tokens < 2:
            raise ConfigError(f"max_context_tokens must be >= 2 to keep a head and a tail, got {max_tokens}")
        self.source, self.tokenizer = source, tokenizer
        if block_chars is None:  # about two chunks of prose: the first call waits for little more than a chunk
            block_chars = min(DEFAULT_BLOCK_CHARS, max(4096, 8 * chunk_tokens))
        self.chunk_tokens, self.max_tokens, self.block_chars = chunk_tokens, max_tokens, block_chars
        self.document_tokens: int | None = None
        self.kept: tuple[tuple[int, int], ...] | None = None
        self._chunks: Iterator[Chunk] | None = None

    def _blocks(self) -> Iterator[TokenBlock]:
        pieces = string_pieces(self.source, self.block_chars) if isinstance(self.source, str) else self.source.pieces()
        return token_blocks(self.tokenizer, pieces, self.block_chars)

    def __iter__(self) -> Iterator[Chunk]:
        if self._chunks is None:
            self._chunks = self._cut(self._read() if self.max_tokens is None else self._read_truncated())
        return self._chunks

    def __next__(self) -> Chunk:
        return next(iter(self))

    def _read(self) -> Iterator[tuple[str, np.ndarray]]:
        """``(text, bounds)`` of the document's blocks, as they are tokenized."""
        for b in self._blocks():
            yield b.text, b.bounds

    def _read_truncated(self) -> Iterator[tuple[str, np.ndarray]]:
        """The blocks of the head and the tail: the document is tokenized once, holding the blocks of the first
        ``head`` tokens and of the last ``tail`` tokens read so far (at most the budget), until its end."""
        tail = self.max_tokens // 2
        head = self.max_tokens - tail
        held: list[TokenBlock] = []  # blocks that start in the head
        recent: deque[TokenBlock] = deque()  # later blocks that may still end in the tail
        n = chars = 0
        for b in self._blocks():
            n, chars = n + b.num_tokens, b.start_char + len(b.text)
            (held if b.start_token < head else recent).append(b)
            while recent and recent[0].start_token + recent[0].num_tokens < n - tail:
                recent.popleft()  # wholly in the middle: never read
        blocks = held + list(recent)
        if n <= self.max_tokens:
            self.document_tokens, self.kept = n, ((0, chars),)
            yield from ((b.text, b.bounds) for b in blocks)
            return
        # the cuts of kept_ranges: the head ends at the last character boundary that keeps at most `head` tokens,
        # the tail starts at the first character boundary that keeps at most `tail` (a character is never split)
        first = n - tail
        hb = next(b for b in held if b.start_token + b.num_tokens >= head)
        hc, hk = _head_cut(hb.bounds, head - hb.start_token)
        tb = next(b for b in blocks if b.start_token + b.num_tokens > first)
        tc = int(tb.bounds[first - tb.start_token])
        tk = int(np.searchsorted(tb.bounds, tc, side="right")) - 1
        self.document_tokens = hb.start_token + hk + n - (tb.start_token + tk)
        self.kept = ((0, hb.start_char + hc), (tb.start_char + tc, chars))
        for b in held:
            if b is hb:
                yield b.text[:hc], b.bounds[: hk + 1]
                break
            yield b.text, b.bounds
        start = next(i for i, b in enumerate(blocks) if b is tb)
        yield tb.text[tc:], tb.bounds[tk:] - tc
        yield from ((b.text, b.bounds) for b in blocks[start + 1:])

    def _cut(self, blocks: Iterator[tuple[str, np.ndarray]]) -> Iterator[Chunk]:
        """:func:`chunk_offsets`'s slices and joining rules over a stream of blocks."""
        size = self.chunk_tokens
        text, text_start = "", 0  # the text read and not yet given out as a chunk, from this character on
        seen_tokens = seen_chars = prev_char = 0
        next_end, index, pending = size, 0, None  # pending: [start_token, end_token, start_char, end_char]

        def span(end: int, c1: int):
            nonlocal pending, prev_char
            c0, start = prev_char, end - size if end % size == 0 else end - end % size
            prev_char, out = c1, None
            if pending and pending[2] == pending[3]:  # zero-width tokens at the start: join the next slice
                pending[1], pending[3] = end, c1
            elif pending and c0 == c1:  # no character starts in this slice: its tokens end the previous chunk's
                pending[1] = end
            else:
                out, pending = pending, [start, end, c0, c1]
            return out

        def emit(p) -> Chunk:
            nonlocal text, text_start, index
            chunk = Chunk(index, p[0], p[1], p[2], p[3], text[p[2] - text_start: p[3] - text_start])
            text, text_start, index = text[p[3] - text_start:], p[3], index + 1
            return chunk

        for block_text, bounds in blocks:
            text += block_text
            n = len(bounds) - 1
            while next_end <= seen_tokens + n:
                done = span(next_end, seen_chars + int(bounds[next_end - seen_tokens]))
                if done:
                    yield emit(done)
                next_end += size
            seen_tokens, seen_chars = seen_tokens + n, seen_chars + len(block_text)
        if seen_tokens > next_end - size and (done := span(seen_tokens, seen_chars)):
            yield emit(done)
        if pending:
            pending[3] = seen_chars if pending[1] == seen_tokens else pending[3]
            yield emit(pending)
        if self.document_tokens is None:
            self.document_tokens, self.kept = seen_tokens, ((0, seen_chars),)

    def count_rest(self) -> int:
        """Read the chunks not read yet (counting their tokens) and return :attr:`document_tokens`."""
        for _ in iter(self):
            pass
        return self.document_tokens
