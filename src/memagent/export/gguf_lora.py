"""A peft LoRA adapter of a llama-architecture model as a llama.cpp LoRA adapter GGUF.

llama.cpp applies a LoRA adapter at run time: for every base weight ``W`` named ``blk.N.attn_q.weight`` the
adapter holds ``blk.N.attn_q.weight.lora_a`` (``(r, in)``, peft's ``lora_A.weight``) and ``...lora_b``
(``(out, r)``, peft's ``lora_B.weight``), and the layer computes ``W x + s * B (A x)`` with
``s = user_scale * alpha / r`` (``alpha`` from the key ``adapter.lora.alpha``; ``alpha = 0`` means ``s =
user_scale``). The file also says ``general.type = adapter`` and ``adapter.type = lora``.

Row order: llama.cpp's llama architecture stores the rows of ``q_proj`` and ``k_proj`` permuted for its
rotary layout (each head's two rotary halves interleaved, :func:`rope_permute`); HF-to-GGUF conversion
permutes them and transformers undoes it when it loads a GGUF. ``B A`` adds to those rows, so ``lora_b`` of
``q`` and ``k`` gets the same row permutation (``lora_a`` acts on the input columns and stays as it is).

Source: llama.cpp ``src/llama-adapter.cpp`` (tensor pairing, shape checks) and ``src/llama-graph.cpp``
(scale); peft ``LoraLayer`` (``scaling = lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from memagent.backends.gguf_copy import write_gguf_atomically
from memagent.errors import ConfigError

#: GGUF architectures whose q/k rows llama.cpp stores permuted for rotary embeddings (HF ``model_type``s).
LLAMA_MODEL_TYPES = ("llama", "mistral")

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")


@dataclass(frozen=True)
class LlamaShape:
    """The facts of a llama model that GGUF tensor names and the q/k row order depend on.

    Attributes:
        n_layers: transformer blocks.
        n_heads: attention (query) heads.
        n_kv_heads: key/value heads (``n_heads`` without grouped-query attention).
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int

    @classmethod
    def from_hf_config(cls, config: Any) -> LlamaShape:
        """From a transformers config (object or dict) of a llama-architecture model.

        Raises:
            ConfigError: the model is not a llama-architecture model.
        """
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        model_type = get("model_type")
        if model_type not in LLAMA_MODEL_TYPES:
            raise ConfigError(f"GGUF export supports llama-architecture models ({', '.join(LLAMA_MODEL_TYPES)}), "
                              f"got model_type {model_type!r}")
        heads = int(get("num_attention_heads"))
        return cls(int(get("num_hidden_layers")), heads, int(get("num_key_value_heads") or heads))


def rope_permute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """HF row order -> llama.cpp row order of a q or k projection (or of a LoRA ``B`` feeding one).

    Within each head of ``head_dim`` rows, HF keeps the first rotary half then the second; llama.cpp
    interleaves them: row ``h*D + 2*i + j`` of the result is row ``h*D + j*D/2 + i`` of ``weight``.

    Args:
        weight: ``(n_heads * head_dim, ...)`` rows in HF order.
        n_heads: heads of this projection (query heads for q, key/value heads for k).

    Returns:
        The rows reordered, same shape and dtype.

    Raises:
        ConfigError: the row count is not a multiple of ``2 * n_heads``.

    Source: llama.cpp ``convert_hf_to_gguf.py`` ``LlamaModel.permute``; transformers
    ``LlamaTensorProcessor._reverse_permute_weights`` is its inverse.
    """
    half = _rotary_half(weight.shape[0], n_heads)
    return weight.reshape(n_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def rope_unpermute(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp row order -> HF row order of a q or k projection: the inverse of :func:`rope_permute`.

    Raises:
        ConfigError: the row count is not a multiple of ``2 * n_heads``.
    """
    half = _rotary_half(weight.shape[0], n_heads)
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _rotary_half(rows: int, n_heads: int) -> int:
    """Rows in each rotary half of a head, for ``rows`` rows of ``n_heads`` heads.

    Raises:
        ConfigError: ``rows`` is not a multiple of ``2 * n_heads``."""
    if n_heads < 1 or rows % (2 * n_heads):
        raise ConfigError(f"cannot permute {rows} rows for {n_heads} rotary heads (need a multiple of {2 * n_heads})")
    return rows // n_heads // 2


def gguf_tensor_name(module: str, shape: LlamaShape) -> str:
    """The GGUF name of the weight of an HF llama module (``model.layers.3.self_attn.q_proj`` ->
    ``blk.3.attn_q.weight``), from the ``gguf`` package's tensor-name map.

    Raises:
        ConfigError: the module has no GGUF tensor.
    """
    import gguf

    name = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, shape.n_layers).get_name(module + ".weight",
                                                                                  try_suffixes=(".weight",))
    if name is None:
        raise ConfigError(f"module {module!r} has no tensor in a llama GGUF; adapt only the attention and MLP "
                          "projections (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)")
    return name


def _rows_permutation(gguf_name: str, shape: LlamaShape) -> int | None:
    """Rotary heads whose row order ``gguf_name`` stores permuted, or ``None``."""
    if gguf_name.endswith(".attn_q.weight"):
        return shape.n_heads
    if gguf_name.endswith(".attn_k.weight"):
        return shape.n_kv_heads
    return None


def split_lora_state_dict(state_dict: Mapping[str, Any], adapter_name: str | None = None) -> dict[str, dict[str, Any]]:
    """Group peft LoRA tensors by the module they adapt.

    Args:
        state_dict: peft names, as saved (``base_model.model.<module>.lora_A.weight``) or as in a live
            ``PeftModel`` (``...lora_A.<adapter>.weight``).
        adapter_name: keep only this adapter's tensors when names carry one; ``None`` keeps names without one
            and fails on several adapters.

    Returns:
        ``{module: {"A": (r, in), "B": (out, r)}}``.

    Raises:
        ConfigError: a tensor is not a LoRA ``A``/``B`` weight (DoRA magnitudes, embedding adapters, modules
            saved in full), a pair is incomplete, or several adapters are mixed.
    """
    pairs: dict[str, dict[str, Any]] = {}
    seen_adapters: set[str] = set()
    for key, value in state_dict.items():
        m = _KEY.match(key)
        if m is None:
            raise ConfigError(f"adapter tensor {key!r} is not a LoRA A/B weight; llama.cpp LoRA adapters hold only "
                              "those (no DoRA magnitudes, embedding adapters or modules_to_save)")
        if m["adapter"] is not None:
            if adapter_name is not None and m["adapter"] != adapter_name:
                continue
            seen_adapters.add(m["adapter"])
        pairs.setdefault(m["module"], {})[m["ab"]] = value
    if len(seen_adapters) > 1:
        raise ConfigError(f"the state dict mixes adapters {sorted(seen_adapters)}; pass adapter_name")
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ConfigError(f"module {module!r} has lora_{''.join(ab)} but not both lora_A and lora_B")
    if not pairs:
        raise ConfigError("the adapter holds no LoRA tensors" + (f" named {adapter_name!r}" if adapter_name else ""))
    return pairs


def _array(t: Any) -> np.ndarray:
    if hasattr(t, "detach"):
        t = t.detach().to("cpu")
        if str(t.dtype) == "torch.bfloat16":
            t = t.float()
        t = t.numpy()
    return np.asarray(t, dtype=np.float32)


def lora_gguf_tensors(
    state_dict: Mapping[str, Any],
    shape: LlamaShape,
    scales: Mapping[str, float] | None = None,
    adapter_name: str | None = None,
) -> list[tuple[str, np.ndarray]]:
    """The adapter's tensors under their llama.cpp names, in llama.cpp's layout (float32).

    Args:
        state_dict: peft LoRA tensors (see :func:`split_lora_state_dict`).
        shape: the base model's layer and head counts.
        scales: per-module factor folded into ``lora_b`` (``None``: none; see :func:`write_lora_gguf`).
        adapter_name: as in :func:`split_lora_state_dict`.

    Returns:
        ``[(name, array)]`` sorted by name: ``<gguf weight>.lora_a`` ``(r, in)`` and ``.lora_b`` ``(out, r)``
        (rows permuted for q and k).

    Raises:
        ConfigError: as :func:`split_lora_state_dict`; a module with no GGUF tensor, or an embedding/output
            module (llama.cpp ties SmolLM2's output to the embedding, which an adapter cannot target here).
    """
    out: list[tuple[str, np.ndarray]] = []
    for module, ab in split_lora_state_dict(state_dict, adapter_name).items():
        name = gguf_tensor_name(module, shape)
        if name.startswith(("token_embd", "output")):
            raise ConfigError(f"module {module!r} ({name}): adapters on the embedding or output layer are not "
                              "exported; leave embed_tokens and lm_head out of the LoRA target modules")
        a, b = _array(ab["A"]), _array(ab["B"])
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise ConfigError(f"module {module!r}: lora_A {a.shape} and lora_B {b.shape} do not make a rank-r pair")
        if scales is not None:
            b = b * np.float32(scales[module])
        heads = _rows_permutation(name, shape)
        if heads is not None:
            b = rope_permute(b, heads)
        out += [(name + ".lora_a", np.ascontiguousarray(a)), (name + ".lora_b", np.ascontiguousarray(b))]
    return sorted(out, key=lambda kv: kv[0])


@dataclass(frozen=True)
class LoraScaling:
    """How peft scales an adapter (from ``adapter_config.json`` or a live ``LoraConfig``).

    Attributes:
        r: rank.
        lora_alpha: alpha; peft's scale is ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``).
        use_rslora: rank-stabilised scaling.
        rank_pattern, alpha_pattern: per-module overrides (peft's regex-suffix keys).
    """

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] | None = None
    alpha_pattern: Mapping[str, float] | None = None

    @classmethod
    def from_peft(cls, config: Any) -> LoraScaling:
        """From a peft ``LoraConfig`` or its JSON dict.

        Raises:
            ConfigError: not a LoRA config, or DoRA (llama.cpp has no magnitude vectors).
        """
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        peft_type = str(get("peft_type", "LORA"))
        if peft_type.split(".")[-1].upper() != "LORA":
            raise ConfigError(f"the adapter is peft type {peft_type!r}, not LORA; only LoRA adapters export to llama.cpp")
        if get("use_dora", False):
            raise ConfigError("DoRA adapters (use_dora=true) cannot be written as a llama.cpp LoRA adapter")
        return cls(int(get("r")), float(get("lora_alpha")), bool(get("use_rslora", False)),
                   dict(get("rank_pattern") or {}) or None, dict(get("alpha_pattern") or {}) or None)

    def uniform(self) -> bool:
        return not (self.rank_pattern or self.alpha_pattern)

    def gguf_alpha(self) -> float:
        """``adapter.lora.alpha`` that makes llama.cpp's ``alpha / r`` equal peft's scale (uniform adapters)."""
        return self.lora_alpha * math.sqrt(self.r) if self.use_rslora else self.lora_alpha


def module_scales(modules: list[str], ranks: Mapping[str, int], settings: LoraScaling) -> dict[str, float]:
    """peft's scale of each module, with ``rank_pattern``/``alpha_pattern`` resolved like peft (a key matches
    a module name that ends with it, as a regex)."""

    def pick(pattern: Mapping[str, Any] | None, module: str, default):
        for key, value in (pattern or {}).items():
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        return default

    scales = {}
    for module in modules:
        r = ranks[module]
        alpha = float(pick(settings.alpha_pattern, module, settings.lora_alpha))
        scales[module] = alpha / math.sqrt(r) if settings.use_rslora else alpha / r
    return scales


def write_lora_gguf(
    state_dict: Mapping[str, Any],
    path: str | os.PathLike,
    shape: LlamaShape,
    settings: LoraScaling,
    adapter_name: str | None = None,
    dtype: str = "f32",
) -> str:
    """Write a peft LoRA adapter as a llama.cpp LoRA adapter GGUF (float32 or float16 tensors), atomically.

    An adapter with one rank and alpha keeps peft's ``A`` and ``B`` and writes ``adapter.lora.alpha`` (times
    ``sqrt(r)`` for rsLoRA, so llama.cpp's ``alpha / r`` equals peft's ``alpha / sqrt(r)``). An adapter with
    per-module ranks or alphas has each module's peft scale folded into its ``lora_b`` and writes
    ``alpha = 0`` (llama.cpp then applies the user scale alone).

    Args:
        state_dict: peft LoRA tensors (saved or live names, see :func:`split_lora_state_dict`).
        path: the ``.gguf`` file to write (replaced if present; readers never see a partial file).
        shape: the base model's layer and head counts (:meth:`LlamaShape.from_hf_config`).
        settings: the adapter's scaling (:meth:`LoraScaling.from_peft`).
        adapter_name: which adapter of a live multi-adapter model.
        dtype: ``"f32"`` or ``"f16"`` (half the file; what a shipped adapter uses).

    Returns:
        ``path`` as a string.

    Raises:
        ConfigError: as :func:`lora_gguf_tensors`, an unknown ``dtype``, or the gguf package is missing.

    Source: llama.cpp ``src/llama-adapter.cpp`` (``general.type``, ``adapter.type``, ``adapter.lora.alpha``).
    """
    try:
        import gguf
    except ImportError as e:
        raise ConfigError(f"writing GGUF files needs the gguf package ({e}); pip install gguf") from e
    if dtype not in ("f32", "f16"):
        raise ConfigError(f"LoRA GGUF dtype must be f32 or f16, got {dtype!r}")
    pairs = split_lora_state_dict(state_dict, adapter_name)
    scales = None
    alpha = settings.gguf_alpha()
    if not settings.uniform():
        ranks = {m: int(_array(ab["A"]).shape[0]) for m, ab in pairs.items()}
        scales, alpha = module_scales(list(pairs), ranks, settings), 0.0
    tensors = lora_gguf_tensors(state_dict, shape, scales, adapter_name)

    def fill(writer) -> None:
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        for name, array in tensors:
            writer.add_tensor(name, array.astype(np.float16) if dtype == "f16" else array)

    return write_gguf_atomically(path, fill)


def write_peft_lora_gguf(model: Any, path: str | os.PathLike, adapter_name: str = "default") -> str:
    """Write the LoRA adapter of a live peft model (what a trainer holds) as a llama.cpp adapter GGUF.

    Args:
        model: a ``peft.PeftModel`` over a llama-architecture transformers model.
        path: the ``.gguf`` file to write.
        adapter_name: the adapter to write.

    Returns:
        ``path`` as a string.

    Raises:
        ConfigError: not a peft model, or as :func:`write_lora_gguf`.
    """
    try:
        from peft import get_peft_model_state_dict
    except ImportError as e:
        raise ConfigError(f"LoRA export needs peft ({e}); pip install peft") from e
    configs = getattr(model, "peft_config", None)
    if not configs or adapter_name not in configs:
        raise ConfigError(f"the model has no peft adapter {adapter_name!r} (adapters: {sorted(configs or {})})")
    base_config = model.get_base_model().config
    state = get_peft_model_state_dict(model, adapter_name=adapter_name)
    return write_lora_gguf(state, path, LlamaShape.from_hf_config(base_config),
                           LoraScaling.from_peft(configs[adapter_name]))


def read_lora_gguf(path: str | os.PathLike, modules: list[str], shape: LlamaShape) -> tuple[dict[str, dict[str, np.ndarray]], float]:
    """Read a llama.cpp LoRA adapter GGUF back into peft's layout (the inverse of :func:`write_lora_gguf`).

    Args:
        path: a LoRA adapter GGUF (``general.type = adapter``, ``adapter.type = lora``), float32 or float16.
        modules: the HF modules the adapter must cover, all of them and no others (e.g.
            ``model.layers.3.self_attn.q_proj``).
        shape: the base model's layer and head counts.

    Returns:
        ``({module: {"A": (r, in), "B": (out, r)}}, alpha)``: float32 arrays, ``B``'s rows of q and k back in HF
        order; ``alpha`` is ``adapter.lora.alpha`` (0: each module's scale is folded into its ``B``).

    Raises:
        ConfigError: not a readable LoRA adapter GGUF, a module the file has no adapter for, tensors for
            modules not in ``modules``, or the gguf package is missing.
    """
    try:
        import gguf
    except ImportError as e:
        raise ConfigError(f"reading GGUF files needs the gguf package ({e}); pip install gguf") from e

    try:
        reader = gguf.GGUFReader(os.fspath(path))
    except Exception as e:  # noqa: BLE001 - gguf raises ValueError, OSError, struct errors alike
        raise ConfigError(f"{os.fspath(path)!r} is not a readable GGUF file ({type(e).__name__}: {e})") from e

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    if field("general.type") != "adapter" or field("adapter.type") != "lora":
        raise ConfigError(f"{os.fspath(path)!r} is not a LoRA adapter GGUF (general.type {field('general.type')!r}, "
                          f"adapter.type {field('adapter.type')!r})")
    tensors = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors}
    out: dict[str, dict[str, np.ndarray]] = {}
    for module in modules:
        name = gguf_tensor_name(module, shape)
        if name + ".lora_a" not in tensors or name + ".lora_b" not in tensors:
            raise ConfigError(f"{os.fspath(path)!r} has no adapter for {module} ({name}.lora_a/.lora_b): it was "
                              "trained on other target modules")
        a, b = tensors.pop(name + ".lora_a"), tensors.pop(name + ".lora_b")
        heads = _rows_permutation(name, shape)
        out[module] = {"A": a, "B": b if heads is None else rope_unpermute(b, heads)}
    if tensors:
        raise ConfigError(f"{os.fspath(path)!r} adapts modules this LoRA does not target ({sorted(tensors)[:3]}, "
                          f"{len(tensors)} tensors): use the target modules it was trained with")
    return out, float(field("adapter.lora.alpha") or 0.0)
