"""A llama GGUF copied with its matrices dequantized (F16 or F32), and the GGUF writing it shares with
:mod:`memagent.export.gguf_model`: the llama.cpp backends' ``smollm2-f16`` model
(:func:`memagent.backends.models.resolve_gguf`) and the training rollout engine's base are such copies.

Source: llama.cpp ``convert_hf_to_gguf.py`` (F16 except 1-D tensors); ``gguf.quants.dequantize`` (the routine
transformers loads a GGUF with).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from memagent.errors import ConfigError

#: GGUF keys rewritten for the new file instead of copied from the base.
_NOT_COPIED = ("general.architecture", "general.file_type", "general.quantization_version")

#: ``llama.*`` GGUF keys and the HF config fields they must agree with.
_SHAPE_KEYS = {
    "llama.block_count": "num_hidden_layers",
    "llama.embedding_length": "hidden_size",
    "llama.feed_forward_length": "intermediate_size",
    "llama.attention.head_count": "num_attention_heads",
    "llama.attention.head_count_kv": "num_key_value_heads",
    "llama.vocab_size": "vocab_size",
}

#: Matrix dtypes of a written GGUF.
DTYPES = {"f16": np.float16, "f32": np.float32}


def base_fields(reader: Any, config: Any) -> list[tuple[str, Any, Any, Any]]:
    """``(key, value, type, sub_type)`` of every base GGUF key to copy, after checking the shape keys."""
    from gguf import GGUFValueType

    get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
    arch = reader.fields.get("general.architecture")
    if arch is None or arch.contents() != "llama":
        found = arch.contents() if arch is not None else None
        raise ConfigError(f"the base GGUF is architecture {found!r}; GGUF export supports llama models")
    fields = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in _NOT_COPIED:
            continue
        if key in _SHAPE_KEYS:
            want = get(_SHAPE_KEYS[key])
            if key == "llama.attention.head_count_kv" and want is None:
                want = get("num_attention_heads")
            if want is not None and int(field.contents()) != int(want):
                raise ConfigError(f"the model's {_SHAPE_KEYS[key]}={want} differs from the base GGUF's {key}="
                                  f"{field.contents()}; export needs the GGUF the run was trained from")
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        fields.append((key, field.contents(), vtype, sub))
    return fields


def write_gguf(path: str | os.PathLike, fields: list, tensors: list[tuple[str, np.ndarray]], dtype: str) -> str:
    """Write a llama GGUF from copied key/values and tensors (:func:`write_gguf_atomically`)."""
    import gguf

    def fill(writer) -> None:
        for key, value, vtype, sub in fields:
            writer.add_key_value(key, value, vtype, sub)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
        for name, array in tensors:
            writer.add_tensor(name, array)

    return write_gguf_atomically(path, fill)


def write_gguf_atomically(path: str | os.PathLike, fill: Callable[[Any], None]) -> str:
    """Write a llama-architecture GGUF at ``path``: ``fill(writer)`` adds its keys and tensors to a
    ``gguf.GGUFWriter`` on a temporary file beside it, which then replaces ``path`` at once (readers never see a
    partial file). An error or Ctrl-C while writing removes the temporary file, which could be hundreds of MB.

    Returns:
        ``path``.
    """
    import gguf

    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    writer = gguf.GGUFWriter(tmp, "llama")
    try:
        try:
            fill(writer)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return path


def write_dequantized_gguf(src: str | os.PathLike, path: str | os.PathLike, dtype: str = "f16") -> str:
    """A copy of a quantized llama GGUF with every matrix dequantized to F16 or F32 (same names, keys and
    tokenizer).

    transformers dequantizes a GGUF with the same routine (``gguf.quants.dequantize``), so an F32 copy holds
    exactly the weights a trainer loads from ``src``, and llama.cpp on it computes what transformers computes
    (to float32 rounding) instead of running quantized kernels: the rollout engine's base for training, with
    the LoRA adapter pushed on top. F16 halves the size and runs faster in batches.

    Args:
        src: the quantized GGUF (e.g. SmolLM2-135M-Instruct Q4_1).
        path: the ``.gguf`` file to write.
        dtype: ``"f16"`` or ``"f32"`` for matrices; 1-D tensors stay float32.

    Returns:
        ``path`` as a string.

    Raises:
        ConfigError: unknown dtype, missing file, or not a llama GGUF.
    """
    import gguf

    if dtype not in DTYPES:
        raise ConfigError(f"GGUF dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    src = os.fspath(src)
    if not os.path.isfile(src):
        raise ConfigError(f"GGUF file not found: {src!r}")
    reader = gguf.GGUFReader(src)
    fields = base_fields(reader, {})
    tensors = []
    for t in reader.tensors:
        array = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        array = array.astype(DTYPES[dtype] if array.ndim > 1 else np.float32)
        tensors.append((t.name, np.ascontiguousarray(array)))
    return write_gguf(path, fields, tensors, dtype)
