"""Output files of ``memagent run`` and ``demo`` (predictions, traces): checked before any model loads, so a
run that cannot write its outputs fails at once, naming the option, instead of after the whole reading."""

from __future__ import annotations

import os
from pathlib import Path

from memagent.errors import MemagentError
from memagent.runfiles.jsonl import JsonlWriter


def check_paths(inputs: dict[str, Path | None], outputs: dict[str, Path | None]) -> None:
    """Refuse an output that is an input or another output, a folder, or in a folder that cannot be written;
    checked before any model loads and before any file is opened, so nothing is overwritten by a run that
    cannot start.

    Args:
        inputs: option flag -> input file (``None``: not given).
        outputs: option flag -> output file (``None``: not given).

    Raises:
        MemagentError: naming the flag, the path and what to do.
    """

    seen: dict[Path, str] = {p.resolve(): flag for flag, p in inputs.items() if p is not None}
    for flag, p in outputs.items():
        if p is None:
            continue
        r = p.resolve()
        if r in seen:
            raise MemagentError(f"{flag} {p} is also {seen[r]}; write {flag} to another file")
        seen[r] = flag
        if p.is_dir():
            raise MemagentError(f"{flag} {p} is a folder; give a file path")
        parent = r.parent
        if parent.exists() and not parent.is_dir():
            raise MemagentError(f"cannot write {flag} {p}: {parent} is a file, not a folder")
        if not parent.is_dir():
            raise MemagentError(f"cannot write {flag} {p}: folder {parent} does not exist")
        if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
            raise MemagentError(f"cannot write {flag} {p}: permission denied")
        _try_open(p, flag)


def _try_open(p: Path, flag: str) -> None:
    """Open ``p`` for appending and close it (nothing written; a file this makes is removed again): the check
    :func:`os.access` cannot make for root, who may "write" /proc or sysfs files that refuse any write."""
    existed = p.exists()
    try:
        with open(p, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise MemagentError(f"cannot write {flag} {p}: {e.strerror or e}") from None
    if not existed:
        p.unlink(missing_ok=True)


def file_option(value: str | None, flag: str, example: str) -> Path | None:
    """An output file option as a path. A value ending in a slash (or in ``/.``, ``/..``) names a folder (a
    ``Path`` would drop the slash and write a file of the folder's name), so it is refused, naming a file path
    to give instead.

    Raises:
        MemagentError: ``value`` names a folder, or is ``-`` (stdout is not a row file).
    """
    if value is None:
        return None
    if value == "-":
        hint = "; without --output the predictions are printed (one JSON row per sample)" if flag == "--output" else ""
        raise MemagentError(f"{flag} - does not write to stdout: give a file path{hint}")
    if value.endswith(("/", os.sep)) or os.path.basename(value) in (".", ".."):
        folder = value.rstrip("/" + os.sep) or "/"
        what = "ends with a slash, so it names a folder" if value.endswith(("/", os.sep)) else "names a folder"
        raise MemagentError(f"{flag} {value} {what}; give a file path, e.g. {flag} {Path(folder) / example}")
    return Path(value)


def check_not_overwriting(outputs: dict[str, Path | None], resumable: bool = True) -> None:
    """Refuse an output file that already holds something (the predictions or trace of an earlier run, maybe
    hours of model time): replacing it takes ``--overwrite``, continuing it ``--resume`` (named only when
    ``resumable``: an ``--input`` run). An empty file is not refused.

    Raises:
        MemagentError: naming the flag, the file and both options.
    """
    for flag, p in outputs.items():
        if p is None or not p.is_file():
            continue
        try:
            size = p.stat().st_size
        except OSError:
            continue
        if size:
            ways = "add --resume to continue that run, or --overwrite to replace the file" if resumable else \
                "add --overwrite to replace it, or give another file"
            raise MemagentError(f"{flag} {p} already holds {size} bytes (an earlier run's rows?); {ways}")


def open_for_writing(path: Path | None, flag: str, append: bool = False):
    """A row writer for an output file (``append``: keep what it holds, after cutting a torn last line);
    ``None`` for no file.

    Raises:
        MemagentError: the file cannot be opened, naming ``flag`` and the reason.
    """
    if path is None:
        return None
    try:
        return JsonlWriter(path, append=append)
    except OSError as e:
        raise MemagentError(f"cannot write {flag} {path}: {e.strerror}") from None
