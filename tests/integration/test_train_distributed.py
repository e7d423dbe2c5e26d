"""2 CPU processes under torchrun (gloo; DDP or FSDP2) give the same gradients and parameters after one training
step as 1 process on the same data, and an FSDP checkpoint resumes in one process."""

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

WORKER = textwrap.dedent("""
    import sys
    import torch
    torch.set_num_threads(1)
    from memagent.train.config import load_config
    from memagent.train.distributed import init_distributed, shutdown
    from memagent.train.synthetic import needle_samples
    from memagent.train.trainer import Trainer

    import dataclasses
    out, agg, strategy = sys.argv[1], sys.argv[2], sys.argv[3]
    info = init_distributed()
    cfg = load_config("configs/train_cpu_small.yaml", [
        f"run.output_dir={out}/run{info.rank}", "run.total_steps=1", "run.val_every=0", "run.save_every=0",
        "run.val_before_train=false", "run.tensorboard=false", "run.resume=false", "rl.group_size=2",
        "rl.prompts_per_step=2", "rl.mini_batches=1", f"rl.agg_mode={agg}", "rl.kl_coef=0.01",
        "agent.batch_size=1", "agent.chunk_tokens=40", "agent.memory_tokens=6", "agent.final_tokens=6",
        "optim.lr=1e-4", "optim.warmup_steps=0", "optim.grad_clip=1e9", "optim.micro_batch_tokens=200",
        f"run.distributed={strategy}",
    ])
    reward = lambda response, answers: float(len(response) % 2)
    samples = needle_samples(2, 12, 0, "t")  # the second document is 3x longer: more chunks, rows and
    samples[1] = dataclasses.replace(samples[1], context=" ".join([samples[1].context] * 3))  # micro-batches
    trainer = Trainer(cfg, info, train_samples=samples, val_samples={}, reward_fn=reward)
    m = trainer.train_step()
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
             for n, p in trainer.policy.named_parameters() if p.grad is not None}  # collective under FSDP
    params, _ = trainer.full_state()
    trainer.save_checkpoint()
    rollout = {k: v.clone() for k, v in trainer.rollout_policy.state_dict().items()}
    import os
    os.makedirs(out, exist_ok=True)
    if info.is_main:
        torch.save({"params": params, "grads": grads, "metrics": m, "rollout": rollout}, f"{out}/result.pt")
    shutdown()
""")


def _run(cmd, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("agg,strategy", [("token-mean", "ddp"), ("traj-mean-token-mean", "ddp"),
                                          ("traj-mean-token-mean", "fsdp")])
def test_two_processes_match_one(tmp_path, agg, strategy):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    _run([sys.executable, str(worker), str(tmp_path / "one"), agg, strategy], repo)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    _run(torchrun + [str(worker), str(tmp_path / "two"), agg, strategy], repo)
    one = torch.load(tmp_path / "one" / "result.pt", weights_only=False)
    two = torch.load(tmp_path / "two" / "result.pt", weights_only=False)
    assert one["metrics"]["reward/mean"] == two["metrics"]["reward/mean"]
    assert 0 < one["metrics"]["reward/mean"] < 1  # a real gradient
    assert one["metrics"]["conv/per_traj_mean"] == two["metrics"]["conv/per_traj_mean"]
    # logged metrics are over all processes, not rank 0's share
    for k in ("loss", "pg/loss", "kl/mean", "entropy/mean", "pg/ratio_mean", "pg/approx_kl", "pg/clip_frac",
              "conv/per_traj_min", "conv/per_traj_max", "response_tokens/mean", "reward/group_pass", "grad_norm"):
        assert two["metrics"][k] == pytest.approx(one["metrics"][k], rel=1e-4, abs=1e-7), k
    assert one["metrics"]["entropy/mean"] > 0 and one["metrics"]["conv/per_traj_min"] < one["metrics"]["conv/per_traj_max"]
    init = torch.load(tmp_path / "one" / "result.pt", weights_only=False)["params"]
    # gradients (AdamW would hide a scale error): DDP's average x world size with global units = 1 process
    assert one["grads"].keys() == two["grads"].keys() and one["grads"]
    for k, g in one["grads"].items():
        torch.testing.assert_close(two["grads"][k], g, atol=1e-7, rtol=1e-4)
    for k, v in one["params"].items():
        torch.testing.assert_close(two["params"][k], v, atol=1e-6, rtol=1e-5)
    from memagent.train.tiny import make_tiny_model, make_tiny_tokenizer

    start = make_tiny_model(make_tiny_tokenizer(), seed=0).state_dict()
    assert any(not torch.equal(start[k], init[k]) for k in start)  # the step moved the weights
    # the rollout engine runs the updated weights (under FSDP: the unsharded copy was refreshed)
    for k, v in two["params"].items():
        torch.testing.assert_close(two["rollout"][k], v, atol=0, rtol=0)
    # uneven work: one rank's document has more chunks than the other's (FSDP pads its forwards)
    assert two["metrics"]["conv/per_traj_min"] < two["metrics"]["conv/per_traj_mean"]
    # the checkpoint holds full, name-keyed state in any layout: the same tensors as the 1-process run's
    ck_one = torch.load(next((tmp_path / "one" / "run0" / "checkpoints").glob("step_*.pt")), weights_only=False)
    ck_two = torch.load(next((tmp_path / "two" / "run0" / "checkpoints").glob("step_*.pt")), weights_only=False)
    assert ck_one["optimizer"]["param_groups"][0]["params"] == ck_two["optimizer"]["param_groups"][0]["params"]
    for name, st in ck_one["optimizer"]["state"].items():
        torch.testing.assert_close(ck_two["optimizer"]["state"][name]["exp_avg"], st["exp_avg"], atol=1e-9, rtol=1e-4)
    for k, v in ck_two["model"].items():
        torch.testing.assert_close(v, two["params"][k], atol=0, rtol=0)
