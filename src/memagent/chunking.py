"""Pure chunking: a document's tokens -> consecutive chunks whose texts join back to the document exactly.

Source: the reference splits the tokenized context into non-overlapping slices ``[i*C, (i+1)*C)`` of
``C = chunk_size`` tokens, the last one shorter (reference doc section 1.2). It decodes each slice back to
text, which can break a multi-byte character at a boundary; memagent instead cuts the original text at the
character offsets of the token boundaries, so no character is lost, duplicated or mangled, and no chunk is
empty (a character longer than a chunk stays whole in the chunk where it starts, see :func:`chunk_offsets`).
"""

from __future__ import annotations

from collections.abc import Sequence

from memagent.data.schema import lone_surrogate
from memagent.errors import ConfigError, DataError
from memagent.tokenization import Tokenizer
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


def center_truncate(text: str, tokenizer: Tokenizer, max_tokens: int | None) -> tuple[str, int]:
    """Keep the first and last ``max_tokens // 2`` tokens of ``text`` (reference "center truncation").

    The head keeps ``max_tokens - max_tokens // 2`` tokens, so an odd budget is used in full. Cuts are made
    at character boundaries of the tokens, so the result is a prefix plus a suffix of ``text``.

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
    _check_encodable(text)
    ids, bounds = tokenizer.encode_with_offsets(text)
    n = len(ids)
    if max_tokens is None or n <= max_tokens:
        return text, n
    if max_tokens < 2:
        raise ConfigError(f"max_context_tokens must be >= 2 to keep a head and a tail, got {max_tokens}")
    tail = max_tokens // 2
    head = max_tokens - tail
    return text[: bounds[head]] + text[bounds[n - tail] :], max_tokens


def _check_encodable(text: str) -> None:
    if (at := lone_surrogate(text)) is not None:
        raise DataError(f"the text holds a lone surrogate U+{ord(text[at]):04X} at character {at}, which no tokenizer "
                        "can encode; remove it")
