"""sha256 of files, read once per version: the identity of model and adapter files in cache records, method
hashes and ``run --resume`` settings."""

from __future__ import annotations

import functools
import hashlib
import os

__all__ = ["file_sha256"]


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of the bytes of the file at ``path``.

    Read in 1 MiB blocks (about 0.2 s for a 100 MB file) and remembered per (resolved path, size, mtime), so a
    caller may ask for every row it writes; a file rewritten in place gets a new mtime and is read again.

    Raises:
        OSError: the file cannot be read.
    """
    real = os.path.realpath(path)
    st = os.stat(real)
    return _sha256(real, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
