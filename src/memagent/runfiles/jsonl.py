"""JSON-lines files that survive a kill: torn-line repair, appends, atomic rewrites.

A process killed while appending leaves at most one *torn* line: the bytes after the file's last newline.
Every reader here ignores it and every writer that continues a file cuts it first, so the next row starts on
a line of its own. Rewrites go through a temporary file replaced at once, so a kill never leaves half a file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any


def repair_tail(path: str | os.PathLike) -> bool:
    """Cut a torn last line (bytes after the last newline) off ``path``; returns whether anything was cut.
    A missing file is left missing."""
    p = Path(path)
    if not p.exists():
        return False
    data = p.read_bytes()
    if not data or data.endswith(b"\n"):
        return False
    with open(p, "r+b") as f:
        f.truncate(data.rfind(b"\n") + 1)
    return True


def complete_lines(path: str | os.PathLike) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` of every newline-terminated line of ``path`` (1-based; a torn last line is
    skipped, blank lines included). A missing file has none."""
    p = Path(path)
    if not p.exists():
        return
    data = p.read_bytes()
    lines = data.split(b"\n")
    lines = lines[:-1]  # after the last newline: "" for a whole file, the torn line otherwise
    yield from enumerate(lines, 1)


def parse_line(line: bytes) -> Any:
    """The JSON value of one line, or ``None`` when it is blank or not JSON (a line torn by a kill)."""
    try:
        return json.loads(line)
    except ValueError:
        return None


def dumps(row: Any) -> str:
    """One JSON line (UTF-8 text kept as it is), newline included."""
    return json.dumps(row, ensure_ascii=False) + "\n"


def rewrite(path: str | os.PathLike, lines: Iterable[bytes]) -> None:
    """Replace ``path`` with ``lines`` (each newline-terminated) through a temporary file, at once.

    Raises:
        OSError: the file cannot be written or replaced (the temporary file is removed).
    """
    p = os.fspath(path)
    tmp = p + ".tmp"
    try:
        with open(tmp, "wb") as f:
            for line in lines:
                f.write(line)
        os.replace(tmp, p)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def keep_lines(path: str | os.PathLike, keep: Callable[[Any], bool]) -> int:
    """Rewrite ``path`` keeping only the lines whose JSON value passes ``keep``; blank lines, lines that are not
    JSON (torn by a kill) and rejected lines are dropped, and a kept last line missing its newline gets one. The
    file is replaced only when something changes.

    Returns:
        the number of lines dropped (0 also when the file does not exist).

    Raises:
        OSError: the file cannot be read or replaced.
    """
    p = Path(path)
    if not p.exists():
        return 0
    out, dropped, changed = [], 0, False
    with open(p, "rb") as src:
        for line in src:
            if keep(parse_line(line)):
                if not line.endswith(b"\n"):  # a whole row whose newline the kill cut off
                    line, changed = line + b"\n", True
                out.append(line)
            else:
                dropped += 1
    if dropped or changed:
        rewrite(p, out)
    return dropped


class JsonlWriter:
    """Appends rows to a JSON-lines file, flushing (and with ``fsync`` syncing) each one.

    Args:
        path: the file; its folder is created when missing.
        append: keep what the file holds (after cutting a torn last line); False starts it empty.
        fsync: sync every row to disk (result files: a row on disk is a sample done).
    """

    def __init__(self, path: str | os.PathLike, append: bool = True, fsync: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if append:
            repair_tail(self.path)
        self._fsync = fsync
        self._f = open(self.path, "a" if append else "w", encoding="utf-8")

    def write(self, row: Any) -> None:
        self.write_many([row])

    def write_many(self, rows: Iterable[Any]) -> None:
        self._f.write("".join(dumps(r) for r in rows))
        self._f.flush()
        if self._fsync:
            os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def append_rows(path: str | os.PathLike, rows: Iterable[Any]) -> None:
    """Append rows to ``path`` (created when missing; a torn last line is cut first)."""
    with JsonlWriter(path) as w:
        w.write_many(rows)
