"""Read and write samples: JSONL, JSON and parquet, our schema and the reference's layouts.

``read_samples(path)`` accepts, by file extension (any case):

- ``.jsonl`` (or ``.ndjson``; also a pipe such as ``/dev/stdin``, and ``-`` for stdin): one object per line (our schema, or any reference layout, see
  :func:`memagent.data.schema.sample_from_reference`); blank lines are skipped;
- ``.json``: a list of such objects (the reference's ``eval_{N}.json`` and ``eval_{task}_{len}.json``),
  ``{"samples": [...]}``, or one sample object; a ``.json`` file of one object per line (JSON Lines, what
  ``datasets``' ``to_json`` writes) is read as ``.jsonl``;
- ``.parquet``: rows of such objects (the reference's training parquet).

Errors name the file, the line (JSONL) or row index (JSON list, parquet) and the field. Writers pick the format
from the extension too and write to a temporary file first, so a crash never leaves half a file.

``read_document_text(path_or_bytes)`` reads one plain-text document whole: decoded by
its byte-order mark (UTF-8, UTF-16, UTF-32) or as UTF-8, refusing a file that looks binary unless asked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from memagent.data.schema import check_unicode, sample_from_hf, sample_from_reference
from memagent.errors import DataError
from memagent.types import Sample

_FORMATS = (".jsonl", ".json", ".parquet")


def _format(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".ndjson"):
        return ".jsonl"
    for ext in _FORMATS:
        if name.endswith(ext):
            return ext
    if path.exists() and not path.is_file() and not path.is_dir():  # a pipe (/dev/stdin, <(cmd)): lines of JSON
        return ".jsonl"
    raise DataError(f"{str(path)!r}: unknown file type; use one of {', '.join(_FORMATS)} (or .ndjson; '-' reads "
                    "JSON lines from stdin)")


def _read_bytes(p: Path) -> bytes:
    try:
        return p.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {str(p)!r}: {e.strerror or e}") from None


# A JSON escape of a surrogate code point (U+D800-U+DFFF): only text holding one can decode to a lone surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _parse_json(text: str, where: str) -> Any:
    """``json.loads`` with every failure as a DataError naming ``where``."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:  # a JSONL line is named by its line already; a whole file by e.lineno
        at = f"column {e.colno}" if e.lineno == 1 else f"line {e.lineno} column {e.colno}"
        raise DataError(f"{where}: invalid JSON ({e.msg} at {at})") from None
    except ValueError as e:  # e.g. an integer of more than 4,300 digits
        raise DataError(f"{where}: invalid JSON ({e})") from None
    except RecursionError:
        raise DataError(f"{where}: invalid JSON (arrays or objects nested too deeply)") from None
    return obj


def _decode(raw: bytes, where: str, first: bool) -> str:
    """UTF-8 text of a line or file (a byte-order mark at the start of the file is dropped).

    Raises:
        DataError: naming ``where`` and the byte offset, with what to do.
    """
    if first and raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise DataError(f"{where}: the file is UTF-16 (it starts with a UTF-16 byte-order mark); re-encode it as "
                        "UTF-8 (e.g. iconv -f utf-16 -t utf-8)")
    try:
        return raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start}); re-encode the file as UTF-8 "
                        "(e.g. iconv -f latin1 -t utf-8)") from None


def _jsonl_records(data: bytes, name: str) -> Iterator[tuple[str, Any]]:
    """``(location, record)`` for every non-blank line of JSON-lines bytes (``name`` for messages)."""
    for lineno, raw in enumerate(data.split(b"\n"), 1):
        line = _decode(raw, f"{name}:{lineno}", lineno == 1)
        if not line.strip():
            continue
        obj = _parse_json(line, f"{name}:{lineno}")
        if _SURROGATE_ESCAPE.search(raw):
            check_unicode(obj, f"{name}:{lineno}")
        yield f"{name}:{lineno}", obj


def _first_line_is_object(text: str) -> bool:
    """Whether the first line of ``text`` is a whole JSON object followed by more lines (JSON Lines in a file
    named ``.json``, as ``datasets``' ``to_json`` writes by default)."""
    head, _, rest = text.lstrip().partition("\n")
    if not head.startswith("{") or not rest.strip():
        return False
    try:
        return isinstance(json.loads(head), dict)
    except (json.JSONDecodeError, ValueError, RecursionError):
        return False


def iter_records(path: str | os.PathLike) -> Iterator[tuple[str, Any]]:
    """Yield ``(location, record)`` for every record of a JSONL / JSON / parquet file.

    ``location`` is ``"<file>:<line>"`` for JSONL and ``"<file>[<row>]"`` otherwise.

    Raises:
        DataError: the file is missing, a folder or unreadable, not UTF-8 (UTF-16 is named as such), a line/file
            is not valid JSON, a record holds a lone surrogate code point (a JSON ``\\ud800`` escape without its
            pair, which no tokenizer can encode; :func:`memagent.data.schema.check_unicode`), or a parquet file
            cannot be read.
    """
    if os.fspath(path) == "-":
        import sys

        yield from _jsonl_records(sys.stdin.buffer.read(), "stdin")
        return
    p = Path(path)
    if p.is_dir():
        raise DataError(f"input file {str(p)!r} is a folder; give a {' or '.join(_FORMATS)} file")
    if not p.exists():
        raise DataError(f"input file {str(p)!r} not found")
    fmt = _format(p)
    if fmt == ".jsonl":
        yield from _jsonl_records(_read_bytes(p), str(p))
    elif fmt == ".json":
        raw = _read_bytes(p)
        text = _decode(raw, str(p), True)
        try:
            data = _parse_json(text, str(p))
        except DataError:
            if not _first_line_is_object(text):
                raise
            yield from _jsonl_records(raw, str(p))
            return
        if isinstance(data, dict) and isinstance(data.get("data"), list) and "version" in data:
            raise DataError(f"{p}: this is the official SQuAD JSON (articles of paragraphs of questions), not a list "
                            "of samples; convert it with memagent.data.squad.load_squad, or load it with `datasets` "
                            "and give the rows' export (to_json / to_parquet) as the input")
        escapes = _SURROGATE_ESCAPE.search(raw) is not None
        if isinstance(data, dict) and isinstance(data.get("samples"), list):
            data = data["samples"]
        elif isinstance(data, dict) and ("question" in data or "input" in data):  # one sample (a one-row export)
            data = [data]
        if not isinstance(data, list):
            raise DataError(f"{p}: expected a JSON list of sample objects, got {type(data).__name__}")
        for i, obj in enumerate(data):
            if escapes:
                check_unicode(obj, f"{p}[{i}]")
            yield f"{p}[{i}]", obj
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(p).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{p}: not a readable parquet file ({e})") from None
        for i, obj in enumerate(rows):
            yield f"{p}[{i}]", obj


def read_samples(path: str | os.PathLike, limit: int | None = None) -> list[Sample]:
    """Read samples from a file (see the module docstring for the accepted formats and layouts).

    Args:
        path: a ``.jsonl``, ``.json`` or ``.parquet`` file.
        limit: read at most this many samples.

    Returns:
        The samples in file order.

    A record of the reference's RULER layout (``eval_{task}_{len}.json``: ``input``, ``outputs``, ``index``)
    gets its place in the file as its id (``"0"``, ``"1"``, ...; ``index`` stays in ``metadata``): the reference
    writes such files in chunks of 16 whose ``index`` restarts at 0 (reference doc section 3.6), and keys
    their items by position.

    Raises:
        DataError: unreadable file, malformed record (message names file, line and field), or duplicate ids.
    """
    out: list[Sample] = []
    seen: dict[str, str] = {}
    for n, (where, obj) in enumerate(iter_records(path)):
        if limit is not None and len(out) >= limit:
            break
        s = sample_from_reference(obj, where)
        if _ruler_reference_record(obj):
            s = dataclasses.replace(s, id=str(n))
        if s.id in seen:
            raise DataError(f"{where}: duplicate sample id {s.id!r} (first at {seen[s.id]}); ids must be unique")
        seen[s.id] = where
        out.append(s)
    return out


def _ruler_reference_record(obj: Any) -> bool:
    """Whether ``obj`` is a record of the reference's RULER files (not one of our samples)."""
    return isinstance(obj, Mapping) and "outputs" in obj and "input" in obj and "id" not in obj and "question" not in obj


#: Byte-order marks and the codec that reads text starting with each (UTF-32 before UTF-16: FF FE 00 00 is both).
_BOMS = ((b"\x00\x00\xfe\xff", "utf-32"), (b"\xff\xfe\x00\x00", "utf-32"), (b"\xef\xbb\xbf", "utf-8-sig"),
         (b"\xfe\xff", "utf-16"), (b"\xff\xfe", "utf-16"))
#: How much of a file the binary check reads, in bytes, and the share of those bytes that may be control
#: characters other than the ones text uses (tab, newline, carriage return, form feed, vertical tab,
#: backspace, escape). Text in any 8-bit encoding has almost none; random bytes have about 10%.
_BINARY_PROBE_BYTES = 65536
_BINARY_SHARE = 0.05
_BINARY_MIN_CONTROLS = 16  # a short text with a stray control character or two is still text
_BINARY_CONTROLS = re.compile(rb"[\x00-\x07\x0e-\x1a\x1c-\x1f]")


def _binary_reason(raw: bytes) -> str | None:
    """Why ``raw`` (without a byte-order mark) looks like a binary file, or ``None`` when it looks like text:
    a NUL byte anywhere, or more than 5% (and more than 16) control bytes that text does not use in its first
    64 KiB. Bytes that
    are not UTF-8 do not count (text in a legacy 8-bit encoding is full of them)."""
    nul = raw.find(b"\x00")
    if nul >= 0:
        return f"it holds NUL bytes (the first at byte {nul}); UTF-16 or UTF-32 text without a byte-order mark does too"
    probe = raw[:_BINARY_PROBE_BYTES]
    odd = len(_BINARY_CONTROLS.findall(probe))
    if odd > max(_BINARY_MIN_CONTROLS, _BINARY_SHARE * len(probe)):
        return f"{odd} of its first {len(probe)} bytes are control characters that text does not use"
    return None


def read_document_text(source: str | os.PathLike | bytes, name: str | None = None, allow_binary: bool = False,
                       warn: Callable[[str], None] | None = None) -> str:
    """The text of a document file (or of bytes already read, e.g. from stdin), decoded the way its bytes say.

    - A byte-order mark picks the encoding: UTF-8, UTF-16 (LE or BE) or UTF-32 (LE or BE); the mark is not
      part of the text.
    - Without one the bytes are UTF-8. Bytes that are not UTF-8 are replaced by U+FFFD, with a warning.
    - A file that looks binary (:func:`_binary_reason`: NUL bytes, or more than 5% (and 16) control bytes
      that text does not use in its first 64 KiB) is refused unless ``allow_binary``; then it is read as UTF-8 with
      replacement, with a warning.
    - An empty (or all-whitespace) document gives a warning: the answer then comes from no memory at all.

    Args:
        source: a file path, or the document's bytes.
        name: how messages name the document (default: the path, or "the document").
        allow_binary: read a file that looks binary anyway (``--allow-binary`` on the command line).
        warn: called with each warning's text; default :func:`warnings.warn`.

    Returns:
        The document text.

    Raises:
        DataError: the path is not a file or cannot be read, or the file looks binary and ``allow_binary`` is
            False (naming the file, the reason, and the flag).
    """
    import warnings

    warn = warn or (lambda msg: warnings.warn(msg, stacklevel=3))
    if isinstance(source, bytes):
        raw, name = source, name or "the document"
    else:
        p = Path(source)
        name = name or str(p)
        if not p.is_file():
            raise DataError(f"{name} is not a file; give the path of a text file (on the command line, '-' reads stdin)")
        try:
            raw = p.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read {name}: {e.strerror or e}") from None
    codec = next((c for bom, c in _BOMS if raw.startswith(bom)), None)
    if codec is None:
        why = _binary_reason(raw)
        if why is not None:
            if not allow_binary:
                raise DataError(f"{name} looks like a binary file, not text ({why}); convert it to text first, or "
                                "pass --allow-binary to read it as UTF-8 anyway")
            warn(f"{name} looks binary ({why}); reading it as UTF-8 text, undecodable bytes replaced by U+FFFD")
        codec = "utf-8"
    try:
        text = raw.decode(codec)
    except UnicodeDecodeError as e:
        label = "UTF-8" if codec.startswith("utf-8") else f"{codec.upper()} (by its byte-order mark)"
        warn(f"{name} is not valid {label} ({e.reason} at byte {e.start}); undecodable bytes are replaced by U+FFFD")
        text = raw.decode(codec, errors="replace")
    if not text.strip():
        warn(f"the document ({name}) is empty or whitespace only: the memory learns nothing from it, the answer "
             "rests on the question alone")
    return text


def samples_from_hf(dataset: Iterable[Any], limit: int | None = None) -> list[Sample]:
    """Convert a Hugging Face ``datasets`` split (HotpotQA distractor or SQuAD v2) into samples.

    Raises:
        DataError: a row has neither layout (names its index).
    """
    out = []
    for i, row in enumerate(dataset):
        if limit is not None and i >= limit:
            break
        out.append(sample_from_hf(row, f"<dataset row {i}>"))
    return out


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def write_records(path: str | os.PathLike, records: Iterable[dict[str, Any]]) -> None:
    """Write plain records as JSONL / JSON / parquet (by extension), atomically.

    Raises:
        DataError: a record holds something JSON cannot (a set, an object); the file is left as it was.
    """
    p = Path(path)
    fmt = _format(p)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp(p)
    try:
        _write_to(tmp, fmt, records)
    except BaseException as e:  # a record that cannot be written: no half-written temporary file is left
        tmp.unlink(missing_ok=True)
        if isinstance(e, (TypeError, ValueError, AttributeError)):
            raise DataError(f"cannot write {p}: {e} (every field must be JSON data: strings, numbers, lists, "
                            "mappings)") from None
        raise
    os.replace(tmp, p)


def _write_to(tmp: Path, fmt: str, records: Iterable[dict[str, Any]]) -> None:
    if fmt == ".jsonl":
        with open(tmp, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    elif fmt == ".json":
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(list(records), f, ensure_ascii=False)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = list(records)
        for r in rows:  # parquet cannot hold an empty struct: store metadata as JSON text
            if "metadata" in r:
                r["metadata"] = json.dumps(r["metadata"], ensure_ascii=False)
        pq.write_table(pa.Table.from_pylist(rows), tmp)


def write_samples(path: str | os.PathLike, samples: Iterable[Sample]) -> None:
    """Write samples in our schema; the format follows the extension (``.jsonl``, ``.json``, ``.parquet``).

    In parquet, ``metadata`` is stored as a JSON string column (read back transparently).
    """
    def rows():
        for k, s in enumerate(samples):
            if not isinstance(s, Sample):
                raise DataError(f"cannot write {path}: samples[{k}] is a {type(s).__name__}, not a Sample (a dict: "
                                "convert it with memagent.data.schema.sample_from_dict)")
            yield s.to_dict()

    write_records(path, rows())
