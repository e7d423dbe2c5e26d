import math

import pytest
import torch

from memagent.errors import DataError
from memagent.rl.kl import kl_penalty
from memagent.rl.losses import AGG_MODES, aggregation_units, aggregation_weights, clipped_pg_loss, policy_loss


def test_kl_estimators_hand_computed():
    logp = torch.tensor([[math.log(0.5), math.log(0.2)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.4)]])
    d0, d1 = math.log(0.5), math.log(2.0)  # ref - logp
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([[-d0, -d1]]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([[0.5 * d0**2, 0.5 * d1**2]]))
    # k3 = exp(d) - d - 1: 0.5 - ln 0.5 - 1 = 0.193147; 2 - ln 2 - 1 = 0.306853
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([[0.193147, 0.306853]]), atol=1e-6, rtol=0)


def test_k3_clamped():
    out = kl_penalty(torch.tensor([0.0, 0.0]), torch.tensor([50.0, -50.0]), "k3")
    # d=50 -> clamp 20 -> e^20 - 21 -> clamp 10; d=-50 -> clamp -20 -> e^-20 + 19 -> clamp 10
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0]))
    with pytest.raises(DataError, match="k1, k2, k3"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_clipped_pg_hand_computed():
    # ratios 1.5, 0.5, 1.1, 5.0 (log-space)
    ratio = torch.tensor([[1.5, 0.5, 1.1, 5.0]])
    logp = torch.log(ratio)
    old = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, 1.0, -2.0, -1.0]])
    loss, m = clipped_pg_loss(logp, old, adv, torch.ones_like(logp), clip_low=0.2, clip_high=0.3, dual_clip=3.0)
    # t0: A=1, r=1.5 -> max(-1.5, -1.3) = -1.3 (clipped)
    # t1: A=1, r=0.5 -> max(-0.5, -0.8) = -0.5
    # t2: A=-2, r=1.1 -> max(2.2, 2.2) = 2.2; dual cap 6 -> 2.2
    # t3: A=-1, r=5.0 -> max(5.0, 1.3) = 5.0; dual cap 3 -> 3.0
    torch.testing.assert_close(loss, torch.tensor([[-1.3, -0.5, 2.2, 3.0]]))
    assert float(m["pg/clip_frac"]) == pytest.approx(0.25)
    assert float(m["pg/dual_clip_frac"]) == pytest.approx(0.25)
    no_dual, _ = clipped_pg_loss(logp, old, adv, torch.ones_like(logp), 0.2, 0.3, None)
    assert float(no_dual[0, 3]) == pytest.approx(5.0)
    with pytest.raises(DataError, match="dual_clip"):
        clipped_pg_loss(logp, old, adv, torch.ones_like(logp), dual_clip=0.5)


MASK = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
TRAJ = torch.tensor([0, 1, 1, 2])


def test_aggregation_weights_hand_computed():
    L = torch.tensor([[1.0, 2.0, 9.0, 9.0], [3.0, 3.0, 3.0, 3.0], [6.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    agg = {mode: float((aggregation_weights(MASK, mode, TRAJ, horizon_tokens=5) * L).sum()) for mode in AGG_MODES}
    # token-mean: (1+2+12+6)/7 = 3
    assert agg["token-mean"] == pytest.approx(3.0)
    # seq-mean-token-mean over 3 non-empty rows: (1.5 + 3 + 6)/3 = 3.5
    assert agg["seq-mean-token-mean"] == pytest.approx(3.5)
    # seq-mean-token-sum: (3 + 12 + 6)/3 = 7
    assert agg["seq-mean-token-sum"] == pytest.approx(7.0)
    # seq-mean-token-sum-norm: 21 / (3 * 5) = 1.4
    assert agg["seq-mean-token-sum-norm"] == pytest.approx(1.4)
    # traj-mean-token-mean: traj0 mean 1.5, traj1 (12+6)/5 = 3.6, traj2 empty -> (1.5+3.6)/2 = 2.55
    assert agg["traj-mean-token-mean"] == pytest.approx(2.55)


def loop_aggregate(L, mask, mode, traj, horizon):
    rows = [[L[b][t] for t in range(len(L[b])) if mask[b][t]] for b in range(len(L))]
    if mode == "token-mean":
        toks = [x for r in rows for x in r]
        return sum(toks) / len(toks)
    nonempty = [r for r in rows if r]
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in nonempty) / len(nonempty)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in nonempty) / len(nonempty)
    if mode == "seq-mean-token-sum-norm":
        return sum(sum(r) for r in nonempty) / (len(nonempty) * horizon)
    per = {}
    for b, r in enumerate(rows):
        per.setdefault(traj[b], []).extend(r)
    means = [sum(v) / len(v) for v in per.values() if v]
    return sum(means) / len(means)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_vectorised_matches_loop(mode):
    g = torch.Generator().manual_seed(1)
    L = torch.randn(9, 7, generator=g)
    mask = (torch.rand(9, 7, generator=g) > 0.4).float()
    mask[4] = 0
    traj = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 4])
    got = float((aggregation_weights(mask, mode, traj, horizon_tokens=11) * L).sum())
    want = loop_aggregate(L.tolist(), mask.tolist(), mode, traj.tolist(), 11)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_weights_split_over_parts_sum_to_whole(mode):
    # two "ranks" holding whole trajectories: global units make the parts add up to the whole
    L = torch.arange(16.0).reshape(4, 4)
    whole = (aggregation_weights(MASK, mode, TRAJ, 5) * L).sum()
    parts = [slice(0, 1), slice(1, 4)]
    total = sum(aggregation_units(MASK[p], mode, TRAJ[p]) for p in parts)
    split = sum((aggregation_weights(MASK[p], mode, TRAJ[p], 5, total_units=total) * L[p]).sum() for p in parts)
    torch.testing.assert_close(split, whole)


def test_policy_loss_combines_terms():
    logp = torch.log(torch.tensor([[0.5, 0.25]]))
    old = logp.clone()
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    mask = torch.ones(1, 2)
    w = aggregation_weights(mask, "token-mean")
    ent = torch.tensor([[1.0, 3.0]])
    loss, m = policy_loss(logp, old, torch.tensor([2.0]), w, mask, ref_logp=ref, kl_coef=0.1, entropy=ent, entropy_coef=0.01)
    # pg: ratio 1 -> -2 per token, mean -2; k3: d=ln0.5 -> 0.193147, d=ln2 -> 0.306853, mean 0.25; entropy mean 2
    assert float(m["pg/loss"]) == pytest.approx(-2.0)
    assert float(m["kl/mean"]) == pytest.approx(0.25, abs=1e-6)
    assert float(m["entropy/mean"]) == pytest.approx(2.0)
    assert float(loss) == pytest.approx(-2.0 + 0.1 * 0.25 - 0.01 * 2.0, abs=1e-6)
    with pytest.raises(DataError, match="ref_logp"):
        policy_loss(logp, old, torch.tensor([2.0]), w, mask, kl_coef=0.1)


def test_policy_loss_gradient_matches_reinforce_at_ratio_one():
    # at r = 1 the clipped surrogate's gradient wrt logp is -A * w
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    w = aggregation_weights(mask, "token-mean")
    loss, _ = policy_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -0.5]), w, mask)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.2, -0.2, 0.0], [0.1, 0.1, 0.1]]))
