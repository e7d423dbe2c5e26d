"""Model GGUF writing on synthetic tensors: names, q/k permutation, dtypes, the dequantized copy."""

from __future__ import annotations

import numpy as np
import pytest

from memagent.errors import ConfigError
from memagent.export.gguf_lora import rope_permute
from memagent.export.gguf_model import model_gguf_tensors, write_dequantized_gguf

gguf = pytest.importorskip("gguf")

CONFIG = {"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "tie_word_embeddings": True}


def test_model_tensors_are_renamed_permuted_and_typed():
    rng = np.random.default_rng(0)
    sd = {
        "model.embed_tokens.weight": rng.standard_normal((10, 8)).astype(np.float32),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((8, 8)).astype(np.float32),
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((4, 8)).astype(np.float32),
        "model.layers.0.input_layernorm.weight": np.ones(8, dtype=np.float32),
        "lm_head.weight": rng.standard_normal((10, 8)).astype(np.float32),
    }
    got = dict(model_gguf_tensors(sd, CONFIG, "f16"))
    assert sorted(got) == ["blk.0.attn_k.weight", "blk.0.attn_norm.weight", "blk.0.attn_q.weight", "token_embd.weight"]
    assert got["blk.0.attn_q.weight"].dtype == np.float16 and got["blk.0.attn_norm.weight"].dtype == np.float32
    np.testing.assert_array_equal(got["blk.0.attn_q.weight"], rope_permute(sd["model.layers.0.self_attn.q_proj.weight"], 2).astype(np.float16))
    np.testing.assert_array_equal(got["blk.0.attn_k.weight"], sd["model.layers.0.self_attn.k_proj.weight"][[0, 2, 1, 3]].astype(np.float16))
    untied = dict(model_gguf_tensors(sd, {**CONFIG, "tie_word_embeddings": False}, "f32"))
    np.testing.assert_array_equal(untied["output.weight"], sd["lm_head.weight"])
    with pytest.raises(ConfigError, match="dtype must be one of"):
        model_gguf_tensors(sd, CONFIG, "q4_0")


def _quantized_gguf(path):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.ffn_up.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.ffn_norm.weight", np.full(64, 0.5, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)


def test_dequantized_copy_keeps_names_and_keys_and_unpacks_the_weights(tmp_path):
    want = _quantized_gguf(tmp_path / "q8.gguf")
    out = write_dequantized_gguf(tmp_path / "q8.gguf", tmp_path / "f32.gguf", "f32")
    r = gguf.GGUFReader(out)
    assert r.fields["llama.block_count"].contents() == 1 and r.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert r.fields["general.file_type"].contents() == int(gguf.LlamaFileType.ALL_F32)
    tensors = {t.name: t for t in r.tensors}
    up = tensors["blk.0.ffn_up.weight"]
    assert up.tensor_type == gguf.GGMLQuantizationType.F32
    np.testing.assert_array_equal(np.array(up.data).reshape(4, 64), want)
    np.testing.assert_array_equal(np.array(tensors["blk.0.ffn_norm.weight"].data), np.full(64, 0.5, dtype=np.float32))


def test_dequantized_copy_refuses_missing_files_and_other_architectures(tmp_path):
    with pytest.raises(ConfigError, match="GGUF file not found"):
        write_dequantized_gguf(tmp_path / "none.gguf", tmp_path / "o.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="architecture 'gpt2'"):
        write_dequantized_gguf(tmp_path / "g.gguf", tmp_path / "o.gguf")
