"""``rl.drop_uniform_groups`` leaves the zero-advantage trajectories out of the update without changing its
policy gradient: with no KL term, one step with and one without it end at the same weights."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memagent.errors import ConfigError  # noqa: E402
from memagent.train.config import load_config  # noqa: E402
from memagent.train.distributed import DistInfo  # noqa: E402
from memagent.train.synthetic import needle_samples  # noqa: E402
from memagent.train.trainer import Trainer  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _step(tmp_path, drop: bool, agg: str):
    cfg = load_config("configs/train_cpu_small.yaml", [
        f"run.output_dir={tmp_path / f'{agg}-{drop}'}", "run.resume=false", "rl.group_size=4",
        "rl.prompts_per_step=2", "rl.mini_batches=1", f"rl.agg_mode={agg}", "rl.kl_coef=0",
        f"rl.drop_uniform_groups={str(drop).lower()}", "optim.warmup_steps=0",
        "agent.chunk_tokens=40", "agent.memory_tokens=6", "agent.final_tokens=6", "agent.batch_size=8",
    ])
    samples = needle_samples(2, 12, 0, "t")
    first = list(samples[0].answers)
    # question 0: every trajectory scores 0 (a uniform group); question 1: the parity of the response's length
    reward = lambda r, a: 0.0 if list(a) == first else float(len(r) % 2)  # noqa: E731
    t = Trainer(cfg, train_samples=samples, val_samples={}, reward_fn=reward)
    init = {n: p.detach().clone() for n, p in t.policy.named_parameters() if p.requires_grad}
    m = t.train_step()
    after = {n: p.detach().clone() for n, p in t.policy.named_parameters() if p.requires_grad}
    assert any(not torch.equal(init[n], w) for n, w in after.items())  # the step moved the policy
    return m, after


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_dropping_uniform_groups_keeps_the_policy_gradient(tmp_path, agg):
    m_all, w_all = _step(tmp_path, False, agg)
    m_drop, w_drop = _step(tmp_path, True, agg)
    assert m_all["reward/mean"] == m_drop["reward/mean"]  # the same rollouts
    # question 0's group (half the trajectories) is uniform; question 1's is not (checked: parities differ)
    assert m_drop["adv/zero_frac"] == pytest.approx(0.5)
    assert 0.3 < m_drop["update/rows_kept_frac"] < 0.7
    assert m_all["update/rows_kept_frac"] == 1.0
    assert m_drop["pg/loss"] == pytest.approx(m_all["pg/loss"], abs=1e-6)
    for name, w in w_all.items():
        assert torch.allclose(w, w_drop[name], atol=1e-6), name


def test_a_step_whose_groups_are_all_uniform_makes_no_update(tmp_path):
    cfg = load_config("configs/train_cpu_small.yaml", [
        f"run.output_dir={tmp_path / 'u'}", "run.resume=false", "rl.group_size=2", "rl.prompts_per_step=2",
        "rl.mini_batches=1", "rl.drop_uniform_groups=true", "agent.chunk_tokens=40", "agent.memory_tokens=6",
        "agent.final_tokens=6", "agent.batch_size=4",
    ])
    t = Trainer(cfg, train_samples=needle_samples(2, 12, 0, "t"), val_samples={}, reward_fn=lambda r, a: 0.0)
    before = {n: p.detach().clone() for n, p in t.policy.named_parameters()}
    m = t.train_step()
    assert m["update/rows_kept_frac"] == 0.0 and m["grad_norm"] == 0.0
    assert all(torch.equal(p, before[n]) for n, p in t.policy.named_parameters())


def test_dropping_uniform_groups_is_refused_under_torchrun(tmp_path):
    cfg = load_config("configs/train_cpu_small.yaml", [
        f"run.output_dir={tmp_path / 'd'}", "run.resume=false", "rl.drop_uniform_groups=true",
        "rl.prompts_per_step=2", "rl.group_size=2", "rl.mini_batches=1",
    ])
    with pytest.raises(ConfigError, match="drop_uniform_groups"):
        Trainer(cfg, dist_info=DistInfo(rank=0, world_size=2, local_rank=0), train_samples=needle_samples(2, 12, 0, "t"),
                val_samples={}, reward_fn=lambda r, a: 0.0)
