"""Run folders: the manifest (provenance of every output), and the lock held by the process writing into it."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from memagent.errors import ConfigError, DataError
from memagent.runfiles.jsonl import rewrite


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """A run folder's ``manifest.json`` as a dict (``{}`` when the file does not exist).

    Raises:
        DataError: the file is not a JSON object (naming it and what to do).
    """
    p = Path(path)
    if not p.exists():
        return {}
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{p}: not a readable manifest ({e}); restore it, or move it away to treat the folder as "
                        "unrecorded (its settings are then not checked)") from None
    if not isinstance(data, dict):
        raise DataError(f"{p}: a manifest is a JSON object, got {type(data).__name__}; restore it or move it away")
    return data


def write_json(path: str | os.PathLike, value: Any, indent: int = 2) -> None:
    """Write ``value`` as JSON to ``path`` at once (through a temporary file); the folder is created."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    rewrite(p, [(json.dumps(value, indent=indent, ensure_ascii=False) + "\n").encode("utf-8")])


def write_manifest(path: str | os.PathLike, manifest: dict[str, Any]) -> dict[str, Any]:
    """Write a manifest with provenance added (package version, git commit, start time); a folder resumed keeps
    its first start time and lists every resume in ``resumed_at``. Returns what was written."""
    old = read_manifest(path)
    out = {**manifest, "package_version": package_version(), "git_commit": git_commit(),
           "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if Path(path).exists():
        out["resumed_at"] = old.get("resumed_at", []) + [out["started_at"]]
        out["started_at"] = old.get("started_at", out["started_at"])
    write_json(path, out)
    return out


def package_version() -> str:
    """memagent's installed version (``unknown`` in a source checkout that is not installed)."""
    try:
        from importlib.metadata import version

        return version("memagent")
    except Exception:  # not installed: source checkout
        return "unknown"


def git_commit() -> str | None:
    """The commit of the checkout memagent runs from, when it is one."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


@contextlib.contextmanager
def run_lock(run_dir: str | os.PathLike, log: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on a run folder (``fcntl.flock`` on ``RUN/.lock``) for the ``with`` block, so that
    two ``memagent eval`` processes never append to one folder at once. The kernel releases the lock when the
    process ends, however it ends, so a killed run never leaves the folder locked; the ``.lock`` file itself
    stays. A no-op where ``fcntl`` does not exist (not POSIX), and, with a warning to ``log``, on a file
    system that refuses locks.

    Raises:
        ConfigError: another process holds the lock (naming the folder).
    """
    path = Path(run_dir) / ".lock"
    with _flock(path, f"run folder {str(run_dir)!r} is locked: another memagent eval is writing to it ({path}); "
                      "wait for it to finish, or use another --output folder",
                f"run folder {str(run_dir)!r}", log):
        yield


@contextlib.contextmanager
def output_lock(output: str | os.PathLike, log: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on one output file (``fcntl.flock`` on ``.NAME.lock`` beside it) for the ``with``
    block: ``memagent run``'s predictions file, so that two ``--resume`` processes never both append the same
    samples. Released by the kernel however the process ends, like :func:`run_lock`.

    Raises:
        ConfigError: another process holds the lock (naming the output).
    """
    out = Path(output)
    path = out.parent / f".{out.name}.lock"
    with _flock(path, f"--output {str(output)!r} is locked: another memagent run is writing to it ({path}); wait "
                      "for it to finish, or give another --output", f"--output {str(output)!r}", log, remove=True):
        yield


@contextlib.contextmanager
def _flock(path: Path, locked: str, what: str, log: Callable[[str], None] | None, remove: bool = False) -> Iterator[None]:
    """A :class:`FolderLock` on ``path`` for the ``with`` block (``locked``: the error when another process holds it;
    ``what``: how a warning names it where the file system refuses locks).

    ``remove``: delete the lock file when the block ends, while still holding it (so a lock beside a user's file
    leaves nothing behind). Safe because no process waits for the lock: one that opened the old file meets it
    held and stops, one that opens after the removal locks a new file once every write of this block is done.
    A process killed inside the block leaves the file, which the next run reuses."""
    lock = FolderLock(path.parent, path.name, locked, what)
    lock.acquire(log)
    try:
        yield
    finally:
        if remove and lock.held:
            with contextlib.suppress(OSError):
                path.unlink()
        lock.release()


class FolderLock:
    """An exclusive, non-blocking ``flock`` on ``FOLDER/NAME`` held from :meth:`acquire` to :meth:`release` (or
    the end of the process, however it ends): for a lock that outlives one ``with`` block, such as a training
    run's, taken when the trainer is built and released when it has trained. A no-op where ``fcntl`` does not
    exist; a warning to ``log`` where the file system refuses locks.

    Args:
        folder: the folder to lock (created if missing).
        name: the lock file's name in it.
        locked: the error when another process holds the lock.
        what: how a warning names the lock where the file system refuses locks (default: the folder).
    """

    def __init__(self, folder: str | os.PathLike, name: str, locked: str, what: str | None = None):
        self.path, self.locked, self._file = Path(folder) / name, locked, None
        self.what = what or str(self.path.parent)

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._file is not None

    def acquire(self, log: Callable[[str], None] | None = None) -> None:
        """Take the lock.

        Raises:
            ConfigError: another process (or another lock object of this process) holds it.
        """
        try:
            import fcntl
        except ImportError:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+b")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            f.close()
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError(self.locked) from None
            (log or (lambda _msg: None))(f"warning: cannot lock {self.what} ({e.strerror or e}); running without "
                                         "a lock")
            return
        self._file = f

    def release(self) -> None:
        """Let the lock go (closing the only descriptor releases it); the lock file stays. Idempotent."""
        f, self._file = self._file, None
        if f is not None:
            f.close()


def folder_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be (or become) an output folder, as words to follow the path in a message ("is a
    file", "is under 'x', which is a file"), or None. Checked before anything is created, so a bad
    ``--out``/``--output`` is an error naming the file rather than a traceback from ``mkdir``."""
    p = Path(path)
    for part in [p, *p.parents]:
        if part.is_symlink() and not part.exists():
            return "is a broken link" if part == p else f"is under {str(part)!r}, a broken link"
        if part.exists():
            if part.is_dir():
                return None
            return "is a file" if part == p else f"is under {str(part)!r}, which is a file"
    return None


def unwritable(path: str | os.PathLike) -> str | None:
    """Why ``path`` (an existing folder, or one to be created) cannot be written, as words to follow the path in a
    message, or None: the nearest existing folder on its way is tried with a scratch folder made and removed at
    once (a read-only or system file system, a folder without write permission), before any model loads."""
    import tempfile

    p = Path(path).absolute()
    near = next((q for q in [p, *p.parents] if q.is_dir()), None)
    if near is None:
        return None
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".memagent-probe-", dir=near))
    except OSError as e:
        return f"cannot be written ({near}: {e.strerror or e})"
    return None


def first_missing(path: str | os.PathLike) -> Path | None:
    """The highest folder on the way to ``path`` (``path`` included) that does not exist yet: what creating
    ``path`` would add, so that a refused run can remove exactly that (see :func:`remove_created`)."""
    p, top = Path(path), None
    for part in [p, *p.parents]:
        if part.exists() or part.is_symlink():
            break
        top = part
    return top


def remove_created(path: str | os.PathLike, top: Path | None) -> None:
    """Remove the empty folders from ``path`` up to ``top`` (the :func:`first_missing` of ``path`` before the
    run), leaving any that hold something; nothing when ``top`` is None (everything existed)."""
    if top is None:
        return
    p = Path(path)
    for part in [p, *p.parents]:
        try:
            part.rmdir()
        except OSError:
            return
        if part == top:
            return
