"""The logged entropy is a token mean of the sampled responses whatever the loss aggregation and whichever
path computes it (the training forward with one mini-batch, a separate scoring pass with several)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memagent.train.config import load_config  # noqa: E402
from memagent.train.synthetic import needle_samples  # noqa: E402
from memagent.train.trainer import Trainer  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _entropy(tmp_path, mini_batches, agg):
    cfg = load_config("configs/train_cpu_small.yaml", [
        f"run.output_dir={tmp_path / f'{agg}{mini_batches}'}", "run.resume=false", "rl.group_size=2",
        "rl.prompts_per_step=2", f"rl.mini_batches={mini_batches}", f"rl.agg_mode={agg}", "rl.horizon_tokens=8",
        "agent.chunk_tokens=40", "agent.memory_tokens=6", "agent.final_tokens=6", "agent.batch_size=4",
    ])
    t = Trainer(cfg, train_samples=needle_samples(2, 12, 0, "t"), val_samples={}, reward_fn=lambda r, a: float(len(r) % 2))
    return t.train_step()["entropy/mean"]


@pytest.mark.parametrize("agg", ["seq-mean-token-sum-norm", "traj-mean-token-mean"])
def test_entropy_is_a_token_mean_on_both_paths(tmp_path, agg):
    token_mean = _entropy(tmp_path, 1, "token-mean")
    assert token_mean > 0.5  # a random tiny model is far from deterministic
    assert _entropy(tmp_path, 1, agg) == pytest.approx(token_mean, rel=1e-5)
    assert _entropy(tmp_path, 2, agg) == pytest.approx(token_mean, rel=1e-4)
