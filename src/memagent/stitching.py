"""Tokenize a text of any length block by block, with the tokens of the whole text.

A BPE tokenizer splits text into pre-tokens by a regular expression before it merges bytes, and no token
crosses a pre-token boundary. Some positions are a pre-token boundary whatever follows, for every byte-level
BPE pre-tokenizer in use (GPT-2, Llama 3, Qwen 2, SmolLM2): the space of a single space between two visible
characters (``"word| next"``), and the start of a visible character after a single newline that follows a
visible one (``"line\\n|Next"``; after a longer run of whitespace, ``"\\r\\n"`` included, GPT-2's ``\\s+(?!\\S)``
would see past the cut). Cut
there, each block's tokens are exactly the whole text's tokens over that block (checked by the property tests
against whole-text tokenization). Cuts are chosen from the text alone (the last such position at or before
each multiple of ``block_chars``), so the blocks do not depend on how the text arrives.

A text with no such position for ``FORCE_AFTER_BLOCKS`` blocks (a long run of CJK characters without a space or
newline) is cut before a punctuation mark that follows a letter or digit, else at a token boundary of that
stretch; the blocks still join to the text exactly, but a token at that one cut may differ from the
whole-text tokenization. A tokenizer that does not stitch even at a space (one that adds a prefix space to
every text) is read as one block.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from memagent.errors import DataError
from memagent.tokenization import Tokenizer, lone_surrogate, token_boundaries

#: Characters per block: the unit of reading and of one tokenizer call (about 16K tokens of English).
DEFAULT_BLOCK_CHARS = 1 << 16
#: Blocks without a safe cut after which a cut is forced (see the module docstring).
FORCE_AFTER_BLOCKS = 16

#: Tokenizer calls at once, over all threads: one per core. Many samples read by many threads then get their
#: blocks in turn instead of all slowing down together (a sample waiting for its first chunk waits for a few
#: blocks, not for every sample's).
_SLOTS = threading.BoundedSemaphore(max(1, os.cpu_count() or 1))

_VISIBLE = r"[^\s\x00-\x1f\x7f]"  # control bytes excluded: llama.cpp vocabularies drop some of them
_SAFE_CUT = re.compile(rf"(?<={_VISIBLE}) (?={_VISIBLE})|(?<={_VISIBLE}\n)(?={_VISIBLE})")
_PUNCT_CUT = re.compile(r"(?<=[^\W_])(?=[^\w\s])")
_STITCH_PROBES = (("Hello", " world, and more"), ("one line\n", "Two"))


@dataclass(frozen=True)
class TokenBlock:
    """One block of a tokenized text.

    Attributes:
        start_char: offset of the block's first character in the text.
        start_token: index of the block's first token in the text's tokens.
        text: the block's characters.
        num_tokens: tokens of the block.
        bounds: ``(num_tokens + 1,)`` character boundaries within the block (``bounds[0] == 0``,
            ``bounds[-1] == len(text)``), or ``None`` when only counts were asked for.
    """

    start_char: int
    start_token: int
    text: str
    num_tokens: int
    bounds: np.ndarray | None = None


def stitches(tokenizer: Tokenizer) -> bool:
    """Whether ``tokenizer`` tokenizes text cut at a safe position as it tokenizes the whole (probed once)."""
    cached = getattr(tokenizer, "_memagent_stitches", None)
    if cached is None:
        cached = all(tokenizer.encode(a + b) == tokenizer.encode(a) + tokenizer.encode(b) for a, b in _STITCH_PROBES)
        try:
            tokenizer._memagent_stitches = cached
        except AttributeError:  # a tokenizer object without a __dict__: probe again next time
            pass
    return cached


def _visible(c: str) -> bool:
    return not c.isspace() and c >= " " and c != "\x7f"


def _last_cut(buf: str, end: int) -> int | None:
    """The last safe cut ``i`` with ``0 < i <= end`` (it may look at ``buf[end]``), or ``None`` (the same
    positions as :data:`_SAFE_CUT`, searched backwards from ``end``)."""
    n, sp_hi, nl_hi = len(buf), min(end, len(buf) - 2), min(end - 1, len(buf) - 2)
    while sp_hi >= 1 or nl_hi >= 1:
        sp = buf.rfind(" ", 1, sp_hi + 1) if sp_hi >= 1 else -1  # " " at sp: between two visible characters
        nl = buf.rfind("\n", 1, nl_hi + 1) if nl_hi >= 1 else -1  # "\n" at nl: the cut is nl + 1
        if sp < 0 and nl < 0:
            return None
        if sp >= nl + 1:
            if sp + 1 < n and _visible(buf[sp - 1]) and _visible(buf[sp + 1]):
                return sp
            sp_hi = sp - 1
        else:
            if nl + 1 < n and _visible(buf[nl - 1]) and _visible(buf[nl + 1]):
                return nl + 1
            nl_hi = nl - 1
    return None


def _last_match(buf: str, end: int, pattern: re.Pattern) -> int | None:
    """The last match of ``pattern`` starting at ``i`` with ``0 < i <= end``, or ``None``."""
    last = None
    for m in pattern.finditer(buf, 1, min(end + 2, len(buf))):
        if m.start() <= end:
            last = m.start()
    return last


def text_blocks(pieces: Iterable[str], block_chars: int = DEFAULT_BLOCK_CHARS, start_char: int = 0,
                tokenizer: Tokenizer | None = None) -> Iterator[tuple[int, str]]:
    """Cut a text given in pieces of any size into blocks at safe cuts (module docstring).

    Args:
        pieces: the text from ``start_char`` on, in pieces.
        block_chars: target block size in characters (> 0).
        start_char: the offset of the first piece in the whole text; a cut made by an earlier pass (or 0).
        tokenizer: used only to force a cut in a long text without any safe position.

    Yields:
        ``(start_char, block)``: consecutive blocks; joined they are the text.
    """
    buf, buf_start, parts, have = "", start_char, [], start_char
    grid = (start_char // block_chars + 1) * block_chars
    for piece in pieces:
        if not piece:
            continue
        parts.append(piece)
        have += len(piece)
        while have >= grid + 2:  # the character after the grid point is read: a cut at the grid point is decidable
            if parts:
                buf, parts = buf + "".join(parts), []
            cut = _last_cut(buf, grid - buf_start)
            if cut is None and grid - buf_start >= FORCE_AFTER_BLOCKS * block_chars:
                cut = _forced_cut(buf, grid - buf_start, tokenizer)
            if cut is None:
                grid += block_chars
                continue
            yield buf_start, buf[:cut]
            buf, buf_start = buf[cut:], buf_start + cut
            grid = (buf_start // block_chars + 1) * block_chars
    buf += "".join(parts)
    if buf:
        yield buf_start, buf


def _forced_cut(buf: str, end: int, tokenizer: Tokenizer | None) -> int | None:
    cut = _last_match(buf, end, _PUNCT_CUT)
    if cut is not None or tokenizer is None:
        return cut
    bounds = token_boundaries(tokenizer, buf[: end + 1])
    inner = bounds[(bounds > 0) & (bounds < end)]
    return int(inner[len(inner) // 2]) if len(inner) else None


def token_blocks(tokenizer: Tokenizer, pieces: Iterable[str], block_chars: int = DEFAULT_BLOCK_CHARS,
                 offsets: bool = True) -> Iterator[TokenBlock]:
    """Tokenize a text block by block (see :func:`text_blocks`).

    Args:
        tokenizer: the model's tokenizer.
        pieces: the text in pieces of any size.
        block_chars: target block size in characters.
        offsets: compute each block's character boundaries (else only its token count).

    Yields:
        :class:`TokenBlock` in order; their texts join to the text, their tokens to its tokens.

    Raises:
        DataError: the text holds a lone surrogate code point, which no tokenizer can encode.
    """
    if not stitches(tokenizer):
        block_chars = 1 << 62  # one block: this tokenizer's tokens change where a text is cut
    token = 0
    for char, block in text_blocks(pieces, block_chars, tokenizer=tokenizer):
        if (at := lone_surrogate(block)) is not None:
            raise DataError(f"the text holds a lone surrogate U+{ord(block[at]):04X} at character {char + at}, which "
                            "no tokenizer can encode; remove it")
        with _SLOTS:
            if offsets:
                bounds = token_boundaries(tokenizer, block).astype(np.int32 if len(block) < 2**31 else np.int64)
                n = len(bounds) - 1
            else:
                bounds, n = None, len(tokenizer.encode(block))
        yield TokenBlock(char, token, block, n, bounds)
        token += n


def string_pieces(text: str, piece_chars: int = DEFAULT_BLOCK_CHARS) -> Iterator[str]:
    """``text`` walked in pieces of ``piece_chars`` characters (one slice held at a time)."""
    for i in range(0, len(text), piece_chars):
        yield text[i: i + piece_chars]
