"""The batched llama.cpp engine's pure parts: prefix groups, waves, sampling log-probabilities."""

from __future__ import annotations

import math

import numpy as np
import pytest

from memagent.backends.llamacpp_engine import (
    PrefixGroup,
    common_prefix_tokens,
    log_softmax_at,
    plan_prefix_groups,
    plan_waves,
)


def test_common_prefix_tokens():
    assert common_prefix_tokens([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix_tokens([1, 2, 3], [1, 2, 3, 4, 5]) == 3
    assert common_prefix_tokens([], [1]) == 0
    assert common_prefix_tokens([7], [8]) == 0


def _rollout_prompts():
    """2 questions x 3 rollouts: head (4) + question (3) + chunk (40) shared within a question, then each
    rollout's own memory (2 tokens)."""
    head = [1, 2, 3, 4]
    prompts = []
    for q in (100, 200):
        body = head + [q, q + 1, q + 2] + list(range(q + 10, q + 50))
        for g in range(3):
            prompts.append(body + [900 + 10 * g + q // 100, 7])
    return prompts


def test_rollouts_of_one_question_share_all_but_their_memory():
    groups = plan_prefix_groups(_rollout_prompts(), min_shared_tokens=16)
    assert groups == [PrefixGroup((0, 1, 2), 47), PrefixGroup((3, 4, 5), 47)]


def test_a_common_opening_does_not_merge_the_groups_in_any_order():
    prompts = _rollout_prompts()
    interleaved = [prompts[i] for i in (0, 3, 1, 4, 2, 5)]
    assert plan_prefix_groups(interleaved, min_shared_tokens=2) == [PrefixGroup((0, 2, 4), 47), PrefixGroup((1, 3, 5), 47)]


def test_a_common_opening_is_shared_when_nothing_longer_is():
    head = list(range(40))
    prompts = [head + [1000 + 7 * k, 5] for k in range(3)]
    assert plan_prefix_groups(prompts, min_shared_tokens=32) == [PrefixGroup((0, 1, 2), 40)]


def test_short_common_prefixes_are_not_shared():
    # the two questions share only the 4-token head: below the threshold, so they stay apart
    groups = plan_prefix_groups(_rollout_prompts(), min_shared_tokens=48)
    assert [g.members for g in groups] == [(0,), (1,), (2,), (3,), (4,), (5,)]
    assert all(g.shared_tokens == 0 for g in groups)


def test_identical_prompts_leave_each_member_its_last_token():
    groups = plan_prefix_groups([[5, 6, 7, 8]] * 3, min_shared_tokens=1)
    assert groups == [PrefixGroup((0, 1, 2), 3)]


def test_a_member_with_a_shorter_common_prefix_lowers_the_groups_share():
    a = list(range(100))
    b = a[:80] + [999] * 20
    c = a[:60] + [555] * 40
    assert plan_prefix_groups([a, b, c], min_shared_tokens=32) == [PrefixGroup((0, 1, 2), 60)]


def test_prompt_joins_the_group_it_shares_most_with():
    a = list(range(50))
    b = list(range(1000, 1050))
    a2 = a[:45] + [7, 7, 7, 7, 7]
    assert plan_prefix_groups([a, b, a2], min_shared_tokens=10) == [PrefixGroup((0, 2), 45), PrefixGroup((1,), 0)]


def test_waves_keep_groups_together_and_split_large_ones():
    groups = [PrefixGroup((0, 1, 2, 3), 40), PrefixGroup((4, 5, 6, 7), 40), PrefixGroup((8,), 0)]
    assert plan_waves(groups, 8) == [groups[:2], [groups[2]]]
    assert plan_waves(groups, 3) == [
        [PrefixGroup((0, 1, 2), 40)], [PrefixGroup((3,), 0), PrefixGroup((4, 5), 40)],
        [PrefixGroup((6, 7), 40), PrefixGroup((8,), 0)],
    ]


def test_waves_of_single_sequences():
    groups = [PrefixGroup((i,), 0) for i in range(3)]
    assert plan_waves(groups, 1) == [[g] for g in groups]


@pytest.mark.parametrize("temperature", [1.0, 0.5, 0.0])
def test_log_softmax_at_temperature(temperature):
    logits = np.array([2.0, 0.0, -1.0], dtype=np.float32)
    t = temperature or 1.0  # greedy reports the untempered distribution
    expected = 2.0 / t - math.log(math.exp(2.0 / t) + 1.0 + math.exp(-1.0 / t))
    assert log_softmax_at(logits, 0, temperature) == pytest.approx(expected, abs=1e-12)
