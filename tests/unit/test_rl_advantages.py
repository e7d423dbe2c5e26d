import math

import pytest
import torch

from memagent.errors import DataError
from memagent.rl.advantages import group_advantages
from memagent.rl.multiconv import broadcast_advantages, check_rows, conversations_per_trajectory, row_loss_mask


def loop_advantages(rewards, groups, normalize_std, singleton="reward", eps=1e-6):
    out = []
    for i, r in enumerate(rewards):
        members = [rewards[j] for j in range(len(rewards)) if groups[j] == groups[i]]
        if len(members) == 1:
            out.append(r if singleton == "reward" else 0.0)
            continue
        mean = sum(members) / len(members)
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1))
        out.append((r - mean) / (std + eps) if normalize_std else r - mean)
    return out


def test_mean_baseline_hand_computed():
    adv, m = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]), torch.tensor([7, 7, 7, 7, 3, 3]))
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0]))
    assert float(m["adv/zero_frac"]) == pytest.approx(2 / 6)
    assert float(m["adv/abs_max"]) == pytest.approx(0.75)


def test_std_normalised_matches_verl_value():
    # ENVIRONMENT.md §4: verl's GRPO advantage of rewards [1, 0, 1, 0] in one group is +-0.866.
    adv, _ = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.long), normalize_std=True)
    # mean 0.5, unbiased std sqrt(1/3) = 0.57735 -> 0.5 / 0.57735 = 0.8660
    torch.testing.assert_close(adv, torch.tensor([0.8660, -0.8660, 0.8660, -0.8660]), atol=1e-4, rtol=0)


def test_group_of_one_rule():
    rewards = torch.tensor([1.0, 0.0, 1.0])
    groups = torch.tensor([0, 1, 1])
    adv, _ = group_advantages(rewards, groups)
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, 0.5]))  # singleton: advantage = raw reward
    adv_std, _ = group_advantages(rewards, groups, normalize_std=True)
    assert float(adv_std[0]) == pytest.approx(1.0 / (1.0 + 1e-6))  # std taken as 1
    adv0, _ = group_advantages(rewards, groups, singleton="zero")
    torch.testing.assert_close(adv0, torch.tensor([0.0, -0.5, 0.5]))


@pytest.mark.parametrize("normalize_std", [False, True])
@pytest.mark.parametrize("singleton", ["reward", "zero"])
def test_vectorised_matches_loop(normalize_std, singleton):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (40,), generator=g).float() * torch.rand(40, generator=g)
    groups = torch.randint(0, 9, (40,), generator=g) * 5 - 3
    adv, _ = group_advantages(rewards, groups, normalize_std=normalize_std, singleton=singleton)
    expected = loop_advantages(rewards.tolist(), groups.tolist(), normalize_std, singleton)
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_bad_shapes_raise():
    with pytest.raises(DataError, match="equal length"):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))


def test_broadcast_and_final_flag():
    # reference §4.4 example: B=4, turns [0,1,2,3], [0,2], [2], final [0,1,2,3]
    rows = torch.tensor([0, 1, 2, 3, 0, 2, 2, 0, 1, 2, 3])
    final = torch.tensor([False] * 7 + [True] * 4)
    check_rows(rows, final, 4)
    adv = broadcast_advantages(torch.tensor([0.5, -0.5, 1.0, 0.0]), rows)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 1.0, 0.0, 0.5, 1.0, 1.0, 0.5, -0.5, 1.0, 0.0]))
    assert conversations_per_trajectory(rows, 4).tolist() == [3, 2, 4, 2]
    resp = torch.ones(11, 3)
    assert row_loss_mask(resp, final).sum() == 33
    masked = row_loss_mask(resp, final, mask_final=True)
    assert masked[:7].sum() == 21 and masked[7:].sum() == 0


def test_check_rows_rejects_missing_or_double_final():
    with pytest.raises(DataError, match=r"\[1\]"):
        check_rows(torch.tensor([0, 1, 0]), torch.tensor([False, False, True]), 2)
    with pytest.raises(DataError, match=r"\[0\]"):
        check_rows(torch.tensor([0, 0, 1]), torch.tensor([True, True, True]), 2)
    with pytest.raises(DataError, match="must lie in"):
        check_rows(torch.tensor([0, 5]), torch.tensor([True, True]), 2)
