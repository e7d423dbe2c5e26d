"""`memagent train --config ... key=value` end to end on the tiny model (one step)."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
typer = pytest.importorskip("typer")

from typer.testing import CliRunner  # noqa: E402

from memagent.train.cli import train_command  # noqa: E402


def test_train_command_one_step(tmp_path):
    app = typer.Typer()
    app.command()(train_command)
    n = torch.get_num_threads()
    try:
        res = CliRunner().invoke(app, [
            "--config", "configs/train_cpu_small.yaml", f"run.output_dir={tmp_path}", "run.total_steps=1",
            "run.val_before_train=false", "run.val_every=0", "run.torch_threads=1", "rl.group_size=2",
            "data.synthetic_context_words=12", "agent.chunk_tokens=48", "agent.memory_tokens=4",
            "agent.final_tokens=4",
        ])
    finally:
        torch.set_num_threads(n)
    assert res.exit_code == 0, res.output
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["conv/per_traj_mean"] >= 2 and rows[0]["reward/mean"] == 0.0
    assert (tmp_path / "checkpoints" / "step_000001.pt").exists()
    bad = CliRunner().invoke(app, ["--config", "configs/train_cpu_small.yaml", "rl.grup_size=2"])
    assert bad.exit_code == 2 and "did you mean rl.group_size" in bad.output


def test_memagent_train_is_mounted(tmp_path):
    from memagent.cli import app

    n = torch.get_num_threads()
    try:
        res = CliRunner().invoke(app, [
            "train", "--config", "configs/train_cpu_small.yaml", f"run.output_dir={tmp_path}", "run.total_steps=1",
            "run.val_before_train=false", "run.val_every=0", "run.torch_threads=1", "rl.group_size=2",
            "data.synthetic_context_words=12", "agent.chunk_tokens=48", "agent.memory_tokens=4",
            "agent.final_tokens=4", "run.tensorboard=false",
        ])
    finally:
        torch.set_num_threads(n)
    assert res.exit_code == 0, res.output
    assert (tmp_path / "checkpoints" / "step_000001.pt").exists()
