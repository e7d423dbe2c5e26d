"""Documents read in pieces: a file, a byte stream (stdin), or an iterator of text.

Each is a :class:`memagent.chunking.TextSource`: the agent cuts its chunks as the pieces arrive
(:class:`memagent.chunking.ChunkStream`), so a document far larger than memory streams through. Files and
streams are decoded as :func:`memagent.data.io.read_document_text` decodes a whole file (byte-order mark, else
UTF-8 with U+FFFD for bad bytes and a warning; a file that looks binary is refused unless ``allow_binary``),
incrementally. Each is read once per sample (center truncation too: see :class:`memagent.chunking.ChunkStream`).
"""

from __future__ import annotations

import codecs
import io
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from typing import IO, Any

from memagent.data.io import _BINARY_PROBE_BYTES, _BOMS, _binary_reason
from memagent.errors import DataError

#: Bytes read per piece from a file or stream.
READ_BYTES = 1 << 16


def _warn_default(msg: str) -> None:
    import warnings

    warnings.warn(msg, stacklevel=4)


class _Decoder:
    """Incremental decoding of a document's bytes with :func:`read_document_text`'s rules."""

    def __init__(self, head: bytes, name: str, allow_binary: bool, warn: Callable[[str], None]):
        self.name, self.allow_binary, self.warn = name, allow_binary, warn
        self.codec = next((c for bom, c in _BOMS if head.startswith(bom)), None)
        self.check_binary = self.codec is None
        if self.check_binary:
            why = _binary_reason(head[:_BINARY_PROBE_BYTES])
            if why is not None:
                self._binary(why)
                self.check_binary = False
        self.codec = self.codec or "utf-8"
        self._dec = codecs.getincrementaldecoder(self.codec)("strict")
        self.offset = 0

    def _binary(self, why: str) -> None:
        if not self.allow_binary:
            raise DataError(f"{self.name} looks like a binary file, not text ({why}); convert it to text first, or "
                            "pass --allow-binary to read it as UTF-8 anyway")
        self.warn(f"{self.name} looks binary ({why}); reading it as UTF-8 text, undecodable bytes replaced by U+FFFD")

    def decode(self, raw: bytes, final: bool = False) -> str:
        if self.check_binary and (nul := raw.find(b"\x00")) >= 0:
            self._binary(f"it holds NUL bytes (the first at byte {self.offset + nul}); UTF-16 or UTF-32 text without "
                         "a byte-order mark does too")
            self.check_binary = False
        state = self._dec.getstate()
        try:
            text = self._dec.decode(raw, final)
        except UnicodeDecodeError as e:
            label = "UTF-8" if self.codec.startswith("utf-8") else f"{self.codec.upper()} (by its byte-order mark)"
            self.warn(f"{self.name} is not valid {label} ({e.reason} at byte {self.offset + e.start}); undecodable "
                      "bytes are replaced by U+FFFD")
            self._dec = codecs.getincrementaldecoder(self.codec)("replace")
            self._dec.setstate(state)
            text = self._dec.decode(raw, final)
        self.offset += len(raw)
        return text


def _check_head(head: bytes, name: str, allow_binary: bool, warn) -> bool:
    """Refuse a binary-looking document (unless ``allow_binary``); warn about an empty one.

    Returns:
        Whether the document is empty or whitespace only (``head`` is all of it): the agent reads it as empty.
    """
    dec = _Decoder(head, name, allow_binary, lambda m: None)
    if len(head) < _BINARY_PROBE_BYTES and not dec.decode(head, final=True).strip():
        warn(f"the document ({name}) is empty or whitespace only: the memory learns nothing from it, the answer "
             "rests on the question alone")
        return True
    return False


def _decoded(chunks: Iterable[bytes], head: bytes, name: str, allow_binary: bool, warn) -> Iterator[str]:
    dec = _Decoder(head, name, allow_binary, warn)
    for raw in chunks:
        if raw:
            yield dec.decode(raw)
    yield dec.decode(b"", final=True)


class FileText:
    """A text file read in pieces, as often as asked (each pass reopens it).

    Args:
        path: the file.
        allow_binary: read a file that looks binary as UTF-8 anyway.
        warn: called with each warning's text (default :func:`warnings.warn`).

    Raises:
        DataError: not a file, unreadable, or binary-looking without ``allow_binary`` (at construction).
    """

    def __init__(self, path: str | os.PathLike, allow_binary: bool = False, warn: Callable[[str], None] | None = None):
        self.path, self.name = os.fspath(path), os.fspath(path)
        self.allow_binary, self.warn = allow_binary, warn or _warn_default
        if not os.path.isfile(self.path):
            raise DataError(f"{self.name} is not a file; give the path of a text file (on the command line, '-' reads stdin)")
        # a binary file: refused before any call; a blank one (whitespace only) is read as empty by the agent
        self.blank = _check_head(self._read_head(), self.name, allow_binary, self.warn)
        self._warned = False

    def _read_head(self) -> bytes:
        try:
            with open(self.path, "rb") as f:
                return f.read(_BINARY_PROBE_BYTES)
        except OSError as e:
            raise DataError(f"cannot read {self.name}: {e.strerror or e}") from None

    def pieces(self) -> Iterator[str]:
        """The text in pieces (each call reads the file again)."""
        warn = self.warn if not self._warned else (lambda m: None)  # warnings once, not once per pass
        self._warned = True
        try:
            with open(self.path, "rb") as f:
                yield from _decoded(iter(lambda: f.read(READ_BYTES), b""), self._read_head(), self.name,
                                    self.allow_binary, warn)
        except OSError as e:
            raise DataError(f"cannot read {self.name}: {e.strerror or e}") from None


class StreamText:
    """A byte stream (stdin) read once, in pieces.

    Args:
        stream: a binary file object (``sys.stdin.buffer``).
        name: how messages name it.
        allow_binary, warn: as :class:`FileText`.

    Raises:
        DataError: binary-looking without ``allow_binary`` (checked on the first 64 KiB, at construction).
    """

    def __init__(self, stream: IO[bytes], name: str = "stdin", allow_binary: bool = False,
                 warn: Callable[[str], None] | None = None):
        self.name, self.allow_binary, self.warn = name, allow_binary, warn or _warn_default
        self._stream = stream
        self._head = stream.read(_BINARY_PROBE_BYTES)
        self.blank = _check_head(self._head, name, allow_binary, self.warn)  # whitespace only: read as empty
        self._used = False

    def pieces(self) -> Iterator[str]:
        """The text in pieces (once: a stream cannot be read again)."""
        if self._used:
            raise DataError(f"{self.name} was read already; a stream is read once")
        self._used = True
        return _decoded(self._raw(), self._head, self.name, self.allow_binary, self.warn)

    def _raw(self) -> Iterator[bytes]:
        yield self._head
        yield from iter(lambda: self._stream.read(READ_BYTES), b"")


class IterText:
    """An iterator of text pieces (any sizes), read once."""

    def __init__(self, pieces: Iterable[str], name: str = "the document"):
        self.name, self._it, self._used = name, iter(pieces), False

    def pieces(self) -> Iterator[str]:
        """The pieces, checked to be strings (once: an iterator cannot be read again)."""
        if self._used:
            raise DataError(f"{self.name} was read already; an iterator is read once")
        self._used = True
        return self._checked()

    def _checked(self) -> Iterator[str]:
        for k, piece in enumerate(self._it):
            if not isinstance(piece, str):
                raise DataError(f"{self.name}: piece {k} is of type {type(piece).__name__}, not str: give text pieces")
            yield piece


def document_source(document: Any, allow_binary: bool = False, warn: Callable[[str], None] | None = None):
    """What the agent reads, from what the Python API takes as a document.

    Args:
        document: a string (returned as is); a path (``os.PathLike``; a ``str`` is text, not a path; a named pipe
            such as ``<(zcat doc.gz)`` or a device such as ``/dev/stdin`` is read once, as a stream); a binary
            file object (decoded by the rules above) or a text one (``open(path)``, ``io.StringIO``, read as it
            is); an iterable of strings (not a mapping or a set); or a :class:`memagent.chunking.TextSource`
            (returned as is).
        allow_binary, warn: as :class:`FileText`.

    Returns:
        A string or a :class:`memagent.chunking.TextSource`; anything else as it came (the agent refuses it,
        naming its type).

    Raises:
        DataError: a file that cannot be read or looks binary.
    """
    from memagent.chunking import TextSource

    if isinstance(document, str) or isinstance(document, TextSource):
        return document
    if isinstance(document, os.PathLike):
        path = os.fspath(document)
        if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):  # a pipe, /dev/stdin
            try:  # read once, in pieces, as stdin is
                return StreamText(open(path, "rb"), path, allow_binary, warn)  # noqa: SIM115 - read until the run ends
            except OSError as e:
                raise DataError(f"cannot read {path}: {e.strerror or e}") from None
        return FileText(document, allow_binary, warn)
    if isinstance(document, (bytes, bytearray)):
        from memagent.data.io import read_document_text

        return read_document_text(bytes(document), allow_binary=allow_binary, warn=warn)
    if isinstance(document, io.TextIOBase):  # open(path), io.StringIO, sys.stdin: already text
        name = str(getattr(document, "name", "the text stream"))
        head = document.read(READ_BYTES)  # all of it when shorter: a blank one is read as empty, as a blank string
        source = IterText(itertools.chain([head], iter(lambda: document.read(READ_BYTES), "")), name)
        source.blank = len(head) < READ_BYTES and not head.strip()
        return source
    if hasattr(document, "read"):
        return StreamText(document, getattr(document, "name", "the stream"), allow_binary, warn)
    if isinstance(document, Iterable) and not isinstance(document, (Mapping, AbstractSet)):
        return IterText(document)
    return document  # not a document (a dict, a set, a number): the agent refuses it by its type
