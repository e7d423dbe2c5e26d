"""sha256 of files, read once per version: the identity of model and adapter files in cache records, method
hashes and ``run --resume`` settings."""

from __future__ import annotations

import functools
import hashlib
import os

__all__ = ["file_sha256", "model_sha256"]


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


#: The files of an HF model folder that decide its outputs (weights, config, tokenizer, chat template).
MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".json", ".model", ".jinja", ".txt")


def model_sha256(path: str | os.PathLike) -> str | None:
    """Hex sha256 identifying a model: a file's bytes (a GGUF), or for an HF model folder the names and bytes of
    its weight, config and tokenizer files (:data:`MODEL_FILE_SUFFIXES`, top level, sorted); ``None`` for a path
    that is neither. Each file is read once per version (:func:`file_sha256`): about 1 s per GB the first time.

    Raises:
        OSError: a file cannot be read.
    """
    real = os.path.realpath(os.path.expanduser(os.fspath(path)))
    if os.path.isfile(real):
        return file_sha256(real)
    if not os.path.isdir(real):
        return None
    digest = hashlib.sha256()
    for name in sorted(os.listdir(real)):
        full = os.path.join(real, name)
        if name.endswith(MODEL_FILE_SUFFIXES) and os.path.isfile(full):
            digest.update(f"{name}\0{file_sha256(full)}\0".encode())
    return digest.hexdigest()
