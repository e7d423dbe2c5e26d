"""The trainer's speed levers end to end on the tiny model: LoRA (the reference is the adapter-disabled policy,
adapter-only checkpoints that resume exactly, the run kind checked on resume, ``adapter/`` for export),
shared-prefix groups (the same loss and gradients as unshared), bf16 compute, any verifier as the reward, and
resume past a corrupted newest checkpoint."""

import json
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from memagent.errors import ConfigError  # noqa: E402
from memagent.train.config import load_config  # noqa: E402
from memagent.train.synthetic import needle_samples  # noqa: E402
from memagent.train.trainer import Trainer  # noqa: E402
from memagent.train.precision import native_bfloat16  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRAIN = needle_samples(4, 12, seed=0, prefix="t")
VAL = {1: needle_samples(1, 12, seed=1, prefix="v")}
LORA = ("model.lora.enabled=true", "model.lora.rank=4", "model.lora.dropout=0.1", "rl.kl_coef=0.05")


def parity_reward(response, answers):
    return float(len(response) % 2)  # a varied reward so the policy gradient is not zero


def _cfg(out, *extra):
    return load_config("configs/train_cpu_small.yaml", [
        f"run.output_dir={out}", "run.total_steps=2", "run.save_every=1", "run.val_every=0",
        "run.val_before_train=false", "run.tensorboard=false", "rl.group_size=2", "rl.prompts_per_step=2",
        "rl.mini_batches=2", "agent.chunk_tokens=48", "agent.memory_tokens=6", "agent.final_tokens=6",
        "optim.lr=1e-2", "optim.warmup_steps=1", "optim.micro_batch_tokens=300", *extra,
    ])


def _trainer(out, *extra):
    return Trainer(_cfg(out, *extra), train_samples=TRAIN, val_samples=VAL, reward_fn=parity_reward)


def _run(out, *extra):
    t = _trainer(out, *extra)
    t.fit()
    return t


def _trainable(trainer):
    return {n: p.detach().clone() for n, p in trainer.policy.named_parameters() if p.requires_grad}


def _metrics(out):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "tokens/"))} for r in rows]  # not wall-clock


# ------------------------------------------------------------------------------------------------- LoRA
def test_lora_run_kill_and_resume_matches_uninterrupted(tmp_path):
    full = _run(tmp_path / "full", *LORA)
    assert full.reference is None and full.ref_scorer is None  # no second model: the adapter-disabled policy
    first = _run(tmp_path / "cut", *LORA, "run.stop_after_step=1")
    assert first.step == 1
    ck = torch.load(tmp_path / "cut" / "checkpoints" / "step_000001.pt", weights_only=False)
    names = set(_trainable(first))
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert set(ck["model"]["adapter"]) == names  # the adapter only, no base weights
    assert set(ck["optimizer"]["state"]) == names
    assert ck["lora"] == {"enabled": True, "rank": 4, "alpha": 16.0, "dropout": 0.1,
                          "target_modules": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                          "init_from": None}
    assert os.path.getsize(tmp_path / "cut" / "checkpoints" / "step_000001.pt") < 200_000  # the base is ~1.5 MB
    resumed = _run(tmp_path / "cut", *LORA)
    assert resumed.step == 2
    a, b = _trainable(full), _trainable(resumed)
    assert any(float(v.abs().max()) > 0 for k, v in a.items() if "lora_B" in k)  # training moved the adapter
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)
    assert _metrics(tmp_path / "cut") == _metrics(tmp_path / "full")
    # what `memagent export` reads: adapter/ (peft save_pretrained) and the resolved config
    adapter = tmp_path / "full" / "adapter"
    assert (adapter / "adapter_config.json").exists() and (adapter / "adapter_model.safetensors").exists()
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    assert json.loads((tmp_path / "full" / "config.json").read_text())["model"]["lora"]["enabled"] is True
    assert not (tmp_path / "full" / "policy").exists()
    from peft import PeftModel

    from memagent.train.tiny import make_tiny_model, make_tiny_tokenizer

    loaded = PeftModel.from_pretrained(make_tiny_model(make_tiny_tokenizer(), seed=0), str(adapter))
    want = dict(full.policy.named_parameters())
    for n, p in loaded.named_parameters():
        if "lora_" in n:
            torch.testing.assert_close(p, want[n], rtol=0, atol=0)


def test_lora_reference_is_the_base_model_in_the_fused_loop(tmp_path):
    t = _trainer(tmp_path / "a", *LORA, "rl.mini_batches=1")
    first, second = t.train_step(), t.train_step()
    assert first["kl/mean"] == 0.0  # B = 0 at the start: the adapted policy is exactly the base
    assert second["kl/mean"] > 1e-6  # after one step the policy has moved away from the adapter-disabled base


def test_resuming_lora_as_full_fine_tuning_or_the_reverse_is_refused(tmp_path):
    _run(tmp_path / "lora", *LORA, "run.stop_after_step=1")
    with pytest.raises(ConfigError, match=r"holds a LoRA run \(rank 4, .*this run asks for full fine-tuning"):
        _trainer(tmp_path / "lora", "rl.kl_coef=0.05", "model.lora.dropout=0.1")
    with pytest.raises(ConfigError, match=r"other LoRA settings \(model.lora.rank: 4 -> 8\)"):
        _trainer(tmp_path / "lora", *LORA, "model.lora.rank=8")
    _run(tmp_path / "full", "run.stop_after_step=1")
    with pytest.raises(ConfigError, match="holds a full fine-tuning run .* asks for LoRA"):
        _trainer(tmp_path / "full", "model.lora.enabled=true")
    assert (tmp_path / "full" / "checkpoints" / "step_000001.pt").exists()  # nothing lost


def test_unknown_lora_target_lists_the_models_modules(tmp_path):
    with pytest.raises(ConfigError) as e:
        _trainer(tmp_path / "a", "model.lora.enabled=true", "model.lora.target_modules=[q_proj, c_attn]")
    assert str(e.value) == ("model.lora.target_modules ['c_attn'] are not modules of this model; it has: "
                            "down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj")


def test_full_fine_tuning_writes_policy_and_config(tmp_path):
    _run(tmp_path / "full", "run.total_steps=1")
    assert (tmp_path / "full" / "policy" / "config.json").exists()
    assert not (tmp_path / "full" / "adapter").exists()
    assert json.loads((tmp_path / "full" / "config.json").read_text())["model"]["lora"]["enabled"] is False


# ------------------------------------------------------------------------------------- shared prefixes
@pytest.mark.parametrize("kind", [(), LORA], ids=["full", "lora"])
def test_one_step_with_shared_prefixes_equals_unshared(tmp_path, monkeypatch, kind):
    import memagent.train.update as update

    plans = []
    plan = update.plan_micro_batches
    monkeypatch.setattr(update, "plan_micro_batches", lambda *a, **k: plans.append(plan(*a, **k)) or plans[-1])
    extra = (*kind, "agent.templates=chunk_first", "rl.mini_batches=1", "rl.group_size=4", "model.lora.dropout=0.0")
    out = {}
    for share in ("false", "true"):
        t = _trainer(tmp_path / share, *extra, f"rl.shared_prefix={share}", "rl.shared_prefix_min_tokens=16")
        grads = {}
        for n, p in t.policy.named_parameters():
            if p.requires_grad:
                p.register_hook(lambda g, n=n: grads.__setitem__(n, grads.get(n, 0) + g.detach().clone()))
        out[share] = (t.train_step(), grads)
    shared_groups = [g for mb in plans[-1] for g in (mb.groups or ()) if g.prefix_tokens]
    assert shared_groups and min(g.prefix_tokens for g in shared_groups) >= 16  # sharing happened
    assert all(mb.groups is None for p in plans[:-1] for mb in p)  # the unshared step did not share
    (m0, g0), (m1, g1) = out["false"], out["true"]
    assert m0["reward/mean"] == m1["reward/mean"]  # the same rollouts
    for key in ("loss", "pg/loss", "kl/mean", "entropy/mean"):
        assert m1[key] == pytest.approx(m0[key], rel=1e-5, abs=1e-7), key
    assert g0.keys() == g1.keys() and g0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-5)


def test_shared_prefix_refuses_gradient_checkpointing():
    with pytest.raises(ConfigError, match="rl.shared_prefix cannot run under model.gradient_checkpointing"):
        load_config(None, ["rl.shared_prefix=true", "model.gradient_checkpointing=true"])


# ---------------------------------------------------------------------------------------- bf16 compute
def test_bf16_compute_autocasts_over_float32_master_weights(tmp_path):
    f32 = _trainer(tmp_path / "a", "rl.mini_batches=1", "run.total_steps=1")
    with warnings.catch_warnings():  # a CPU without native bfloat16 warns that it is slow there
        warnings.simplefilter("ignore")
        bf16 = _trainer(tmp_path / "b", "rl.mini_batches=1", "run.total_steps=1", "model.compute_dtype=bfloat16")
    assert bf16.scorer.compute_dtype == "bfloat16"
    auto = _trainer(tmp_path / "c", "rl.mini_batches=1", "run.total_steps=1", "model.compute_dtype=auto")
    assert auto.scorer.compute_dtype == ("bfloat16" if native_bfloat16("cpu") else "float32")
    assert {p.dtype for p in bf16.policy.parameters()} == {torch.float32}  # master weights stay float32
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    a, _ = f32.scorer(ids, torch.ones_like(ids))
    b, _ = bf16.scorer(ids, torch.ones_like(ids))
    assert b.dtype == torch.float32
    assert 0 < float((a - b).detach().abs().max()) < 0.1  # bfloat16 matmuls: close, not equal
    m = bf16.train_step()
    assert all(p.dtype == torch.float32 for p in bf16.policy.parameters()) and m["grad_norm"] > 0


# ---------------------------------------------------------------------------------------------- reward
def test_reward_takes_any_verifier_through_score(tmp_path):
    from memagent.scoring import score

    for name in ("string_match_guarded", "string_match_all", "sub_em", "strict_boxed"):
        cfg = _cfg(tmp_path / name, f"rl.reward={name}")
        t = Trainer(cfg, train_samples=TRAIN, val_samples=VAL)
        for response in ("The answer is \\boxed{4521873}.", "4521873", "maybe 123"):
            assert t.reward_fn(response, ["4521873"]) == score(name, response, ["4521873"])
    t = Trainer(_cfg(tmp_path / "s", "rl.reward=strict_boxed"), train_samples=TRAIN, val_samples=VAL)
    assert t.reward_fn("4521873", ["4521873"]) == 0.0  # strict: the raw response, no box -> 0
    assert Trainer(_cfg(tmp_path / "e", "rl.reward=sub_em"), train_samples=TRAIN,
                   val_samples=VAL).reward_fn("4521873", ["4521873"]) == 1.0
    with pytest.raises(ConfigError, match=r"rl.reward: unknown verifier 'sub_emm'; did you mean sub_em\?"):
        load_config(None, ["rl.reward=sub_emm"])


# --------------------------------------------------------------------------------- corrupted checkpoint
def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    full = _run(tmp_path / "full")
    ckpts = sorted((tmp_path / "full" / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == ["step_000001.pt", "step_000002.pt"]
    data = ckpts[-1].read_bytes()
    ckpts[-1].write_bytes(data[: len(data) // 2])  # a kill or a full disk mid-write
    with pytest.warns(UserWarning, match=r"checkpoint .*step_000002\.pt cannot be read .*resuming from the previous"):
        redone = _trainer(tmp_path / "full")
    assert redone.step == 1
    redone.fit()
    a, b = full.policy.state_dict(), redone.policy.state_dict()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)
    for p in sorted((tmp_path / "full" / "checkpoints").iterdir()):
        p.write_bytes(b"not a checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match=r"no checkpoint in .*checkpoints can be read: .*step_000002\.pt "
                                              r"\(.*\); .*step_000001\.pt"):
            _trainer(tmp_path / "full")
    assert len(os.listdir(tmp_path / "full" / "checkpoints")) == 2  # nothing deleted
