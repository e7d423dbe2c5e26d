"""Linear interpolation of two llama.cpp LoRA adapters of one base model, written as one adapter of twice the rank.

    python docs/results/ruler_rl/probe_interp/interpolate.py A.gguf B.gguf WEIGHT OUT.gguf

The result's weight delta is exactly ``WEIGHT * delta(A) + (1 - WEIGHT) * delta(B)`` for every adapted matrix: with
``delta = scale * B @ A`` (``lora_b`` of shape (out, r), ``lora_a`` of shape (r, in), scale = alpha / r), the pair
``lora_a = [A_a; A_b]`` (2r, in) and ``lora_b = [w * B_a, (1 - w) * B_b]`` (out, 2r) with alpha doubled keeps the
scale and gives the sum. Both inputs must have the same tensors, rank and alpha (two checkpoints of one run family).
Averaging the A and B matrices themselves would not give this delta (the product of averages is not the average of
products). The output is f16, as `memagent export --format lora-gguf --dtype f16` writes.
"""
from __future__ import annotations

import sys

import gguf
import numpy as np


def read(path: str) -> tuple[float, dict[str, np.ndarray]]:
    """An adapter's alpha and its tensors by name (numpy shapes: lora_a (r, in), lora_b (out, r))."""
    reader = gguf.GGUFReader(path)
    field = reader.fields["adapter.lora.alpha"]
    alpha = float(field.parts[field.data[0]][0])
    return alpha, {t.name: np.asarray(t.data, dtype=np.float32) for t in reader.tensors}


def interpolate(a_path: str, b_path: str, weight: float, out: str) -> None:
    """Write the rank-2r adapter whose delta is ``weight * delta(a) + (1 - weight) * delta(b)``.

    Raises:
        SystemExit: the two adapters differ in alpha, tensor names or shapes, or weight is outside [0, 1].
    """
    if not 0.0 <= weight <= 1.0:
        raise SystemExit(f"WEIGHT must lie in [0, 1], got {weight}")
    alpha_a, ta = read(a_path)
    alpha_b, tb = read(b_path)
    if alpha_a != alpha_b or set(ta) != set(tb) or any(ta[n].shape != tb[n].shape for n in ta):
        raise SystemExit(f"{a_path} and {b_path} are not two adapters of one shape (alpha {alpha_a} vs {alpha_b})")
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 2.0 * alpha_a)  # scale alpha / r is unchanged at rank 2r
    for name in ta:
        if name.endswith(".lora_a"):
            merged = np.concatenate([ta[name], tb[name]], axis=0)
        elif name.endswith(".lora_b"):
            merged = np.concatenate([weight * ta[name], (1.0 - weight) * tb[name]], axis=1)
        else:
            raise SystemExit(f"{name}: not a LoRA tensor")
        writer.add_tensor(name, merged.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    if len(sys.argv) != 5:
        raise SystemExit(__doc__)
    interpolate(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4])
