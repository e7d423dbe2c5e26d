"""The llama.cpp LoRA adapter writer on synthetic adapters: names, row permutation, scaling, refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from memagent.errors import ConfigError
from memagent.export.gguf_lora import (
    LlamaShape,
    LoraScaling,
    gguf_tensor_name,
    lora_gguf_tensors,
    rope_permute,
    split_lora_state_dict,
    write_lora_gguf,
)

gguf = pytest.importorskip("gguf")

SHAPE = LlamaShape(n_layers=2, n_heads=4, n_kv_heads=2)  # head_dim 4: q has 16 rows, k has 8
P = "base_model.model.model.layers"


def test_rope_permute_interleaves_each_heads_two_halves():
    rows = np.arange(8, dtype=np.float32).reshape(8, 1)
    # 2 heads of 4 rows: HF (0 1 | 2 3) -> llama.cpp (0 2 1 3), per head
    assert rope_permute(rows, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert rope_permute(rows, 1)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_rope_permute_is_undone_by_transformers_gguf_loader():
    pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.random.default_rng(0).standard_normal((24, 5)).astype(np.float32)
    undo = LlamaTensorProcessor(config={})._reverse_permute_weights
    np.testing.assert_array_equal(undo(rope_permute(w, 3), 3), w)
    np.testing.assert_array_equal(undo(rope_permute(w, 2), 6, 2), w)  # k: kv heads


def test_rope_permute_refuses_rows_that_do_not_split_into_heads():
    with pytest.raises(ConfigError, match="multiple of 8"):
        rope_permute(np.zeros((12, 3)), 4)


@pytest.mark.parametrize("module,name", [
    ("model.layers.0.self_attn.q_proj", "blk.0.attn_q.weight"),
    ("model.layers.1.self_attn.k_proj", "blk.1.attn_k.weight"),
    ("model.layers.1.self_attn.v_proj", "blk.1.attn_v.weight"),
    ("model.layers.0.self_attn.o_proj", "blk.0.attn_output.weight"),
    ("model.layers.1.mlp.gate_proj", "blk.1.ffn_gate.weight"),
    ("model.layers.1.mlp.up_proj", "blk.1.ffn_up.weight"),
    ("model.layers.0.mlp.down_proj", "blk.0.ffn_down.weight"),
])
def test_gguf_tensor_names(module, name):
    assert gguf_tensor_name(module, SHAPE) == name


def test_unknown_module_is_refused():
    with pytest.raises(ConfigError, match="no tensor in a llama GGUF"):
        gguf_tensor_name("model.layers.0.self_attn.qkv_proj", SHAPE)


def _adapter(r=2, modules=("q_proj", "k_proj", "v_proj"), live=False):
    rng = np.random.default_rng(1)
    out_rows = {"q_proj": 16, "k_proj": 8, "v_proj": 8}
    sd = {}
    for m in modules:
        tail = ".default.weight" if live else ".weight"
        sd[f"{P}.0.self_attn.{m}.lora_A{tail}"] = rng.standard_normal((r, 16)).astype(np.float32)
        sd[f"{P}.0.self_attn.{m}.lora_B{tail}"] = rng.standard_normal((out_rows[m], r)).astype(np.float32)
    return sd


def test_lora_tensors_keep_a_and_permute_only_q_and_k_rows_of_b():
    sd = _adapter()
    got = dict(lora_gguf_tensors(sd, SHAPE))
    assert sorted(got) == [f"blk.0.attn_{p}.weight.lora_{ab}" for p in "kqv" for ab in "ab"]
    for p, m in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
        np.testing.assert_array_equal(got[f"blk.0.attn_{p}.weight.lora_a"], sd[f"{P}.0.self_attn.{m}.lora_A.weight"])
    b_q, b_k, b_v = (sd[f"{P}.0.self_attn.{m}.lora_B.weight"] for m in ("q_proj", "k_proj", "v_proj"))
    # q: 4 heads of 4 rows; within each head rows (0 1 2 3) -> (0 2 1 3)
    np.testing.assert_array_equal(got["blk.0.attn_q.weight.lora_b"], b_q[[0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15]])
    np.testing.assert_array_equal(got["blk.0.attn_k.weight.lora_b"], b_k[[0, 2, 1, 3, 4, 6, 5, 7]])  # 2 kv heads
    np.testing.assert_array_equal(got["blk.0.attn_v.weight.lora_b"], b_v)


def test_live_peft_names_with_adapter_name():
    live = _adapter(live=True)
    assert sorted(split_lora_state_dict(live, "default")) == [f"model.layers.0.self_attn.{m}" for m in ("k_proj", "q_proj", "v_proj")]
    with pytest.raises(ConfigError, match="no LoRA tensors named 'other'"):
        split_lora_state_dict(live, "other")


@pytest.mark.parametrize("key,match", [
    (f"{P}.0.self_attn.q_proj.lora_magnitude_vector.weight", "not a LoRA A/B weight"),
    ("base_model.model.lm_head.weight", "not a LoRA A/B weight"),
])
def test_non_lora_tensors_are_refused(key, match):
    sd = _adapter()
    sd[key] = np.zeros(16, dtype=np.float32)
    with pytest.raises(ConfigError, match=match):
        lora_gguf_tensors(sd, SHAPE)


def test_half_a_pair_is_refused():
    sd = _adapter(modules=("q_proj",))
    del sd[f"{P}.0.self_attn.q_proj.lora_B.weight"]
    with pytest.raises(ConfigError, match="has lora_A but not both"):
        lora_gguf_tensors(sd, SHAPE)


def test_output_layer_adapter_is_refused():
    sd = {"base_model.model.lm_head.lora_A.weight": np.zeros((2, 16)), "base_model.model.lm_head.lora_B.weight": np.zeros((50, 2))}
    with pytest.raises(ConfigError, match="embedding or output layer"):
        lora_gguf_tensors(sd, SHAPE)


def _read(path):
    r = gguf.GGUFReader(path)
    fields = {k: r.fields[k].contents() for k in ("general.type", "general.architecture", "adapter.type", "adapter.lora.alpha")}
    return fields, {t.name: np.array(t.data) for t in r.tensors}


def test_written_file_has_adapter_keys_and_tensors(tmp_path):
    sd = _adapter()
    path = write_lora_gguf(sd, tmp_path / "a.gguf", SHAPE, LoraScaling(r=2, lora_alpha=4.0))
    fields, tensors = _read(path)
    assert fields == {"general.type": "adapter", "general.architecture": "llama", "adapter.type": "lora",
                      "adapter.lora.alpha": 4.0}
    np.testing.assert_array_equal(tensors["blk.0.attn_v.weight.lora_b"], sd[f"{P}.0.self_attn.v_proj.lora_B.weight"])
    assert tensors["blk.0.attn_q.weight.lora_a"].shape == (2, 16)
    assert not list(tmp_path.glob("*.tmp*"))


def test_rslora_alpha_gives_llama_cpp_the_peft_scale(tmp_path):
    fields, _ = _read(write_lora_gguf(_adapter(r=4), tmp_path / "a.gguf", SHAPE,
                                      LoraScaling(r=4, lora_alpha=8.0, use_rslora=True)))
    # llama.cpp scales by alpha / r; peft's rsLoRA by lora_alpha / sqrt(r) = 8 / 2 = 4
    assert fields["adapter.lora.alpha"] / 4 == pytest.approx(4.0)


def test_per_module_alpha_is_folded_into_b(tmp_path):
    sd = _adapter(r=2)
    settings = LoraScaling(r=2, lora_alpha=4.0, alpha_pattern={"v_proj": 1.0})
    fields, tensors = _read(write_lora_gguf(sd, tmp_path / "a.gguf", SHAPE, settings))
    assert fields["adapter.lora.alpha"] == 0.0  # llama.cpp: scale = the user scale alone
    np.testing.assert_allclose(tensors["blk.0.attn_v.weight.lora_b"], sd[f"{P}.0.self_attn.v_proj.lora_B.weight"] * 0.5)
    np.testing.assert_allclose(tensors["blk.0.attn_k.weight.lora_b"],
                               sd[f"{P}.0.self_attn.k_proj.lora_B.weight"][[0, 2, 1, 3, 4, 6, 5, 7]] * 2.0)


def test_settings_refuse_dora_and_other_peft_types():
    with pytest.raises(ConfigError, match="DoRA"):
        LoraScaling.from_peft({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_dora": True})
    with pytest.raises(ConfigError, match="not LORA"):
        LoraScaling.from_peft({"peft_type": "IA3"})
    s = LoraScaling.from_peft({"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_rslora": True})
    assert s.gguf_alpha() == pytest.approx(16 * math.sqrt(8))


def test_shape_from_hf_config_refuses_other_architectures():
    assert LlamaShape.from_hf_config({"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9,
                                      "num_key_value_heads": 3}) == LlamaShape(30, 9, 3)
    with pytest.raises(ConfigError, match="model_type 'gpt2'"):
        LlamaShape.from_hf_config({"model_type": "gpt2"})
