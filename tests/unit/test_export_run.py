"""``memagent export`` on tiny runs: the run-folder contract, its refusals, the hf and lora-gguf formats."""

from __future__ import annotations

import json

import numpy as np
import pytest

from memagent.errors import ConfigError
from memagent.export.run import export_run, find_policy

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

IDS = torch.tensor([[5, 17, 99, 3, 250, 42, 7]])


def _config(run, base="tiny", seed=0):
    run.mkdir(exist_ok=True)
    (run / "config.json").write_text(json.dumps({"model": {"path": base}, "run": {"seed": seed}}))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A tiny LoRA run: base = tiny model of seed 3, a random non-zero adapter on q, k, v, o and up."""
    from memagent.train.tiny import make_tiny_model, make_tiny_tokenizer

    run = tmp_path_factory.mktemp("lora_run")
    _config(run, seed=3)
    tok = make_tiny_tokenizer()
    base = make_tiny_model(tok, seed=3)
    with torch.no_grad():
        base_logits = base(IDS).logits
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"])
    pm = peft.get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        logits = pm(IDS).logits
    pm.save_pretrained(run / "adapter")
    return run, logits, base_logits


def test_missing_and_empty_runs_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="run folder not found"):
        find_policy(tmp_path / "nope")
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(ConfigError, match=r"holds no trained policy.*\['checkpoints'\].*resume it to the end"):
        find_policy(tmp_path)


def test_an_adapter_folder_without_weights_is_refused(tmp_path):
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="needs adapter_config.json and adapter_model.safetensors"):
        find_policy(tmp_path)


def test_full_run_exports_hf_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from memagent.train.tiny import save_tiny

    run = tmp_path / "run"
    _config(run)
    save_tiny(run / "policy", seed=1)
    out = export_run(run, tmp_path / "out", "hf")
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(run / "policy")(IDS).logits
        got = AutoModelForCausalLM.from_pretrained(out)(IDS).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_full_run_refuses_lora_gguf_and_gguf_without_a_gguf_base(tmp_path):
    from memagent.train.tiny import save_tiny

    run = tmp_path / "run"
    _config(run)
    save_tiny(run / "policy")
    with pytest.raises(ConfigError, match="trained without LoRA"):
        export_run(run, tmp_path / "a", "lora-gguf")
    with pytest.raises(ConfigError, match="base GGUF, but this run's base is 'tiny'"):
        export_run(run, tmp_path / "b", "gguf")
    with pytest.raises(ConfigError, match="--format must be one of"):
        export_run(run, tmp_path / "c", "onnx")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(ConfigError, match="not an empty directory"):
        export_run(run, tmp_path / "full", "hf")
    assert (tmp_path / "full" / "x").read_text() == "keep me"


def test_lora_run_exports_a_merged_hf_model(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM

    run, logits, base_logits = lora_run
    out = export_run(run, tmp_path / "hf", "hf")
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out)(IDS).logits
    assert (got - base_logits).abs().max() > 0.05  # the adapter is in
    torch.testing.assert_close(got, logits, rtol=0, atol=1e-5)
    assert not any(p.name.startswith("adapter") for p in (tmp_path / "hf").iterdir())  # a plain model


def test_lora_run_exports_the_adapter_as_llama_cpp_lora(lora_run, tmp_path):
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import load_file

    from memagent.export.gguf_lora import rope_permute

    run, _, _ = lora_run
    path = export_run(run, tmp_path / "lora", "lora-gguf")
    r = gguf.GGUFReader(path)
    assert r.fields["adapter.type"].contents() == "lora"
    assert r.fields["adapter.lora.alpha"].contents() == 8.0
    tensors = {t.name: np.array(t.data) for t in r.tensors}
    assert len(tensors) == 2 * 5 * 2  # 2 layers x 5 modules x (a, b)
    saved = load_file(run / "adapter" / "adapter_model.safetensors")
    b_q = saved["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"].numpy()
    np.testing.assert_array_equal(tensors["blk.1.attn_q.weight.lora_b"], rope_permute(b_q, 4))
    a_up = saved["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"].numpy()
    np.testing.assert_array_equal(tensors["blk.0.ffn_up.weight.lora_a"], a_up)


def test_export_command_reports_refusals(tmp_path):
    from typer.testing import CliRunner

    from memagent.cli import app

    res = CliRunner().invoke(app, ["export", str(tmp_path), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert "holds no trained policy" in res.output


def _lora_checkpoint(path, adapter, step=3):
    """A checkpoint shaped as memagent train writes one for a LoRA run (model.adapter keyed by live peft names)."""
    lora = {"enabled": True, "rank": 4, "alpha": 8.0, "dropout": 0.0,
            "target_modules": ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj"), "init_from": None}
    torch.save({"step": step, "lora": lora, "model": {"adapter": adapter, "base_fingerprint": "x"}}, path)


def _live_adapter(run):
    """The run's saved adapter under the names a live peft model gives its parameters (adapter 'default')."""
    from safetensors.torch import load_file

    saved = load_file(run / "adapter" / "adapter_model.safetensors")
    return {k.replace(".weight", ".default.weight"): v for k, v in saved.items()}


def test_a_kept_step_exports_its_own_adapter_not_the_newest(lora_run, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    pytest.importorskip("gguf")
    run, _, _ = lora_run
    doubled = {k: 2 * v for k, v in _live_adapter(run).items()}  # step 3 differs from adapter/
    (run / "checkpoints").mkdir(exist_ok=True)
    _lora_checkpoint(run / "checkpoints" / "step_000003.pt", doubled)
    twin = tmp_path / "twin"  # the same run with the doubled adapter as its newest policy
    shutil.copytree(run, twin, ignore=shutil.ignore_patterns("checkpoints"))
    saved = load_file(run / "adapter" / "adapter_model.safetensors")
    save_file({k: 2 * v for k, v in saved.items()}, twin / "adapter" / "adapter_model.safetensors")
    want = export_run(twin, tmp_path / "want", "lora-gguf", "f16")
    newest = export_run(run, tmp_path / "newest", "lora-gguf", "f16")
    step3 = export_run(run, tmp_path / "step3", "lora-gguf", "f16", checkpoint=3)
    by_name = export_run(run, tmp_path / "name", "lora-gguf", "f16", checkpoint="step_000003.pt")
    by_path = export_run(run, tmp_path / "path", "lora-gguf", "f16", checkpoint=str(run / "checkpoints" / "step_000003.pt"))
    with open(want, "rb") as a, open(step3, "rb") as b, open(by_name, "rb") as c, open(by_path, "rb") as d, \
            open(newest, "rb") as e:
        got = b.read()
        assert a.read() == got == c.read() == d.read()
        assert e.read() != got


def test_a_kept_step_with_a_zero_adapter_exports_the_base_model(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM

    run, _, base_logits = lora_run
    zero = {k: torch.zeros_like(v) if ".lora_B." in k else v for k, v in _live_adapter(run).items()}
    _lora_checkpoint(tmp_path / "zero.pt", zero)
    out = export_run(run, tmp_path / "hf", "hf", checkpoint=tmp_path / "zero.pt")
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out)(IDS).logits
    torch.testing.assert_close(got, base_logits, rtol=0, atol=1e-5)


def test_a_full_fine_tuning_checkpoint_exports_its_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    from memagent.train.tiny import make_tiny_model, make_tiny_tokenizer, save_tiny

    run = tmp_path / "run"
    _config(run, seed=1)
    save_tiny(run / "policy", seed=1)
    trained = make_tiny_model(make_tiny_tokenizer(), seed=2)  # other weights than the run's base (seed 1)
    (run / "checkpoints").mkdir()
    torch.save({"step": 4, "model": trained.state_dict()}, run / "checkpoints" / "step_000004.pt")
    out = export_run(run, tmp_path / "hf", "hf", checkpoint="4")
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out)(IDS).logits
        want = trained(IDS).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_missing_and_foreign_checkpoints_are_refused(lora_run, tmp_path):
    run, _, _ = lora_run
    (run / "checkpoints").mkdir(exist_ok=True)
    _lora_checkpoint(run / "checkpoints" / "step_000003.pt", _live_adapter(run))
    with pytest.raises(ConfigError, match=r"step_000007.pt does not exist; the run kept steps \[3\]"):
        export_run(run, tmp_path / "a", "lora-gguf", checkpoint=7)
    with pytest.raises(ConfigError, match="run folder not found"):
        export_run(tmp_path / "nope", tmp_path / "a", "lora-gguf", checkpoint=3)
    with pytest.raises(ConfigError, match="neither a step number, nor a file"):
        export_run(run, tmp_path / "b", "lora-gguf", checkpoint="last")
    torch.save({"weights": 1}, tmp_path / "other.pt")
    with pytest.raises(ConfigError, match="not a memagent training checkpoint"):
        export_run(run, tmp_path / "c", "lora-gguf", checkpoint=tmp_path / "other.pt")
    (tmp_path / "junk.pt").write_text("not a pickle")
    with pytest.raises(ConfigError, match="cannot be read"):
        export_run(run, tmp_path / "d", "lora-gguf", checkpoint=tmp_path / "junk.pt")
    torch.save({"config": {"model": {"path": "smollm2"}}, "lora": {}, "model": {"adapter": {}}}, tmp_path / "x.pt")
    with pytest.raises(ConfigError, match="trained on model.path 'smollm2', but .* names 'tiny'"):
        export_run(run, tmp_path / "e", "lora-gguf", checkpoint=tmp_path / "x.pt")
    assert not any((tmp_path / n).exists() for n in "abcde")  # nothing half-written
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".memagent-export-")]  # temporary folders gone


def test_a_full_checkpoint_is_refused_as_lora_gguf_before_any_loading(tmp_path):
    run = tmp_path / "run"
    _config(run, base="no-such-base")  # loading this base would fail with another message
    (run / "checkpoints").mkdir()
    torch.save({"step": 2, "model": {"w": torch.zeros(1)}}, run / "checkpoints" / "step_000002.pt")
    with pytest.raises(ConfigError, match=r"--checkpoint .*step_000002.pt' was trained without LoRA"):
        export_run(run, tmp_path / "o", "lora-gguf", checkpoint="02")
    with pytest.raises(ConfigError, match="base is 'no-such-base'"):
        export_run(run, tmp_path / "o", "gguf", checkpoint=2)
    with pytest.raises(ConfigError, match="not a local file or directory"):
        export_run(run, tmp_path / "o", "hf", checkpoint=2)
