"""2 CPU processes under torchrun (gloo, DDP) give the same parameters after one training step as 1 process
on the same data."""

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

    out, agg = sys.argv[1], sys.argv[2]
    info = init_distributed()
    cfg = load_config("configs/train_cpu_small.yaml", [
        f"run.output_dir={out}/run{info.rank}", "run.total_steps=1", "run.val_every=0", "run.save_every=0",
        "run.val_before_train=false", "run.tensorboard=false", "run.resume=false", "rl.group_size=2",
        "rl.prompts_per_step=2", "rl.mini_batches=1", f"rl.agg_mode={agg}", "rl.kl_coef=0.01",
        "agent.batch_size=1", "agent.chunk_tokens=40", "agent.memory_tokens=6", "agent.final_tokens=6",
        "optim.lr=1e-4", "optim.warmup_steps=0", "optim.grad_clip=1e9", "optim.micro_batch_tokens=200",
    ])
    reward = lambda response, answers: float(len(response) % 2)
    trainer = Trainer(cfg, info, train_samples=needle_samples(2, 12, 0, "t"), val_samples={}, reward_fn=reward)
    m = trainer.train_step()
    import os
    os.makedirs(out, exist_ok=True)
    if info.is_main:
        grads = {n: p.grad.clone() for n, p in trainer.policy.named_parameters() if p.grad is not None}
        torch.save({"params": trainer.policy.state_dict(), "grads": grads, "metrics": m}, f"{out}/result.pt")
    shutdown()
""")


def _run(cmd, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("agg", ["token-mean", "traj-mean-token-mean"])
def test_two_processes_match_one(tmp_path, agg):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    _run([sys.executable, str(worker), str(tmp_path / "one"), agg], repo)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    _run(torchrun + [str(worker), str(tmp_path / "two"), agg], repo)
    one = torch.load(tmp_path / "one" / "result.pt", weights_only=False)
    two = torch.load(tmp_path / "two" / "result.pt", weights_only=False)
    assert one["metrics"]["reward/mean"] == two["metrics"]["reward/mean"]
    assert 0 < one["metrics"]["reward/mean"] < 1  # a real gradient
    assert one["metrics"]["conv/per_traj_mean"] == two["metrics"]["conv/per_traj_mean"]
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
