"""A full HF llama model as a GGUF that llama.cpp runs (``--backend llamacpp --model OUT.gguf``).

The weights come from the trained model (F16 or F32 tensors; norms stay F32); everything else, the
architecture keys, the tokenizer and the chat template, is copied from the GGUF the run started from, so
llama.cpp tokenizes and templates exactly as it did for the base model. q and k rows are permuted into
llama.cpp's rotary layout (:func:`memagent.export.gguf_lora.rope_permute`). :func:`write_dequantized_gguf`
copies a quantized GGUF with its matrices dequantized (the engine's base for training rollouts).

Source: llama.cpp ``convert_hf_to_gguf.py`` (tensor names, q/k permutation, F16 except 1-D tensors).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from memagent.errors import ConfigError
from memagent.export.gguf_lora import LlamaShape, rope_permute

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

DTYPES = {"f16": np.float16, "f32": np.float32}


def model_gguf_tensors(
    state_dict: Mapping[str, Any], config: Any, dtype: str = "f16"
) -> list[tuple[str, np.ndarray]]:
    """The model's weights under llama.cpp names, q/k rows permuted.

    Args:
        state_dict: HF names (``model.layers.0.self_attn.q_proj.weight`` ...) to tensors or arrays.
        config: the model's transformers config (object or dict).
        dtype: ``"f16"`` or ``"f32"`` for matrices; 1-D tensors (norms) are always float32.

    Returns:
        ``[(gguf name, array)]`` in the state dict's order; a tied ``lm_head`` is left out (llama.cpp reads
        the output layer from ``token_embd`` when ``output.weight`` is absent).

    Raises:
        ConfigError: unknown dtype, a non-llama model, or a tensor with no GGUF name.
    """
    import gguf

    from memagent.export.gguf_lora import _array

    if dtype not in DTYPES:
        raise ConfigError(f"GGUF dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    shape = LlamaShape.from_hf_config(config)
    get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
    tied = bool(get("tie_word_embeddings", False))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, shape.n_layers)
    out = []
    for key, value in state_dict.items():
        if key == "lm_head.weight" and tied:
            continue
        if key.endswith("rotary_emb.inv_freq"):
            continue  # recomputed by llama.cpp from llama.rope.freq_base
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ConfigError(f"tensor {key!r} has no name in a llama GGUF; is this a plain llama model?")
        array = _array(value)
        if name.endswith("attn_q.weight"):
            array = rope_permute(array, shape.n_heads)
        elif name.endswith("attn_k.weight"):
            array = rope_permute(array, shape.n_kv_heads)
        array = array.astype(DTYPES[dtype] if array.ndim > 1 else np.float32)
        out.append((name, np.ascontiguousarray(array)))
    return out


def _base_fields(reader: Any, config: Any) -> list[tuple[str, Any, Any, Any]]:
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


def write_model_gguf(
    state_dict: Mapping[str, Any],
    config: Any,
    base_gguf: str | os.PathLike,
    path: str | os.PathLike,
    dtype: str = "f16",
) -> str:
    """Write a llama model as a GGUF with the base GGUF's metadata and tokenizer, atomically.

    Args:
        state_dict: the model's HF weights (LoRA already merged).
        config: its transformers config.
        base_gguf: the GGUF the model was loaded from before training (source of every non-weight key:
            tokenizer, chat template, rope and norm settings).
        path: the ``.gguf`` file to write.
        dtype: ``"f16"`` (half the size) or ``"f32"`` (exact) for matrices.

    Returns:
        ``path`` as a string.

    Raises:
        ConfigError: the base file is missing or not a llama GGUF, its shape keys disagree with ``config``,
            the base holds weights the model lacks, or as :func:`model_gguf_tensors`.
    """
    import gguf

    base = os.fspath(base_gguf)
    if not os.path.isfile(base):
        raise ConfigError(f"base GGUF not found: {base!r}; GGUF export copies its tokenizer and metadata")
    reader = gguf.GGUFReader(base)
    fields = _base_fields(reader, config)
    tensors = model_gguf_tensors(state_dict, config, dtype)
    written = {n for n, _ in tensors}
    missing = [t.name for t in reader.tensors if t.name not in written and t.name != "output.weight"]
    if missing:
        raise ConfigError(f"the base GGUF has tensors the model does not provide: {missing[:5]}")
    return _write(path, fields, tensors, dtype)


def _write(path: str | os.PathLike, fields: list, tensors: list[tuple[str, np.ndarray]], dtype: str) -> str:
    """Write a llama GGUF from copied key/values and tensors, atomically (readers never see a partial file)."""
    import gguf

    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    writer = gguf.GGUFWriter(tmp, "llama")
    try:
        for key, value, vtype, sub in fields:
            writer.add_key_value(key, value, vtype, sub)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32)
        for name, array in tensors:
            writer.add_tensor(name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    os.replace(tmp, path)
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
    fields = _base_fields(reader, {})
    tensors = []
    for t in reader.tensors:
        array = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(d) for d in reversed(t.shape)))
        array = array.astype(DTYPES[dtype] if array.ndim > 1 else np.float32)
        tensors.append((t.name, np.ascontiguousarray(array)))
    return _write(path, fields, tensors, dtype)
