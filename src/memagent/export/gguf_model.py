"""A full HF llama model as a GGUF that llama.cpp runs (``--backend llamacpp --model OUT.gguf``).

The weights come from the trained model (F16 or F32 tensors; norms stay F32); everything else, the
architecture keys, the tokenizer and the chat template, is copied from the GGUF the run started from, so
llama.cpp tokenizes and templates exactly as it did for the base model. q and k rows are permuted into
llama.cpp's rotary layout (:func:`memagent.export.gguf_lora.rope_permute`). :func:`write_dequantized_gguf`
(:mod:`memagent.backends.gguf_copy`, re-exported) copies a quantized GGUF with its matrices dequantized.

Source: llama.cpp ``convert_hf_to_gguf.py`` (tensor names, q/k permutation, F16 except 1-D tensors).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from memagent.backends.gguf_copy import DTYPES, base_fields, write_dequantized_gguf, write_gguf
from memagent.errors import ConfigError
from memagent.export.gguf_lora import LlamaShape, rope_permute

__all__ = ["DTYPES", "model_gguf_tensors", "write_dequantized_gguf", "write_model_gguf"]


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
    fields = base_fields(reader, config)
    tensors = model_gguf_tensors(state_dict, config, dtype)
    written = {n for n, _ in tensors}
    missing = [t.name for t in reader.tensors if t.name not in written and t.name != "output.weight"]
    if missing:
        raise ConfigError(f"the base GGUF has tensors the model does not provide: {missing[:5]}")
    return write_gguf(path, fields, tensors, dtype)


