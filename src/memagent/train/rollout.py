"""Rollouts: G full MemAgent trajectories per question, their rewards, and their training rows.

Trajectories come from the same :class:`memagent.agent.loop.MemoryAgent` that ``memagent run`` and
evaluation use, so the prompts trained on are the prompts served. Rows keep the exact token ids the backend
sampled (``Turn.prompt_token_ids`` / ``Turn.response_token_ids``); nothing is re-tokenised.

Source: reference-memagent.md §4.4 (rows, ``sample_index``, ``final_mask``), §4.7 steps 1-3, §4.9.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from memagent.errors import BackendError, DataError
from memagent.types import Sample, Trajectory

RewardFn = Callable[[str, Sequence[str]], float]


@dataclass(frozen=True)
class Row:
    """One conversation of one trajectory, as trained.

    Attributes:
        prompt_ids: ``(T_prompt,)`` exact prompt ids the model saw (chat template included).
        response_ids: ``(T_resp,)`` exact sampled ids (with the stop token when the model emitted it).
        traj_index: index of the trajectory in the step's rollout (0..N-1).
        group_id: the GRPO group (the question's index in the step).
        is_final: True for the final-answer conversation, the one that carries the reward.
    """

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    traj_index: int
    group_id: int
    is_final: bool

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(frozen=True)
class Rollout:
    """All trajectories of one training step.

    Attributes:
        rows: every conversation of every trajectory, trajectory-major, turns in order.
        rewards: ``(N,)`` reward of each trajectory.
        group_ids: ``(N,)`` group of each trajectory.
        trajectories: the agent's trajectories (for logs).
        seconds: wall time of the rollout.
    """

    rows: tuple[Row, ...]
    rewards: tuple[float, ...]
    group_ids: tuple[int, ...]
    trajectories: tuple[Trajectory, ...]
    seconds: float

    @property
    def response_tokens(self) -> int:
        return sum(len(r.response_ids) for r in self.rows)


def repeat_samples(samples: Sequence[Sample], group_size: int) -> list[Sample]:
    """Each sample ``group_size`` times, consecutively, with ids ``"{id}#g{j}"`` (distinct sampling seeds).

    Raises:
        DataError: ``group_size < 1``.
    """
    if group_size < 1:
        raise DataError(f"group_size must be >= 1, got {group_size}")
    return [replace(s, id=f"{s.id}#g{j}") for s in samples for j in range(group_size)]


def trajectory_rows(traj: Trajectory, traj_index: int, group_id: int) -> list[Row]:
    """Training rows of one trajectory (updates in chunk order, then the final answer).

    Raises:
        DataError: the trajectory failed, has no final turn, or a turn lacks token ids (the backend does
            not expose them: train with an in-process backend such as ``hf``).
    """
    if traj.error is not None:
        raise DataError(f"trajectory {traj.sample_id} failed ({traj.error}); training stops on a failed rollout")
    if not traj.turns or traj.turns[-1].kind != "final":
        raise DataError(f"trajectory {traj.sample_id} has no final turn")
    rows = []
    for t in traj.turns:
        if t.prompt_token_ids is None or t.response_token_ids is None:
            raise DataError(
                f"trajectory {traj.sample_id}: the backend returned no token ids; rollouts need an in-process "
                "backend that exposes them (hf)"
            )
        rows.append(Row(tuple(t.prompt_token_ids), tuple(t.response_token_ids), traj_index, group_id, t.kind == "final"))
    return rows


def collect_rollouts(agent, samples: Sequence[Sample], group_size: int, reward_fn: RewardFn | None = None) -> Rollout:
    """Sample ``group_size`` trajectories per question with ``agent`` and score them.

    Args:
        agent: a :class:`memagent.agent.loop.MemoryAgent` whose backend returns token ids; its config sets
            temperature, top-p and seed.
        samples: the step's questions (with gold answers).
        group_size: G, trajectories per question.
        reward_fn: ``(final response, gold answers) -> float``; default the strict training reward,
            ``memagent.scoring.score("strict_boxed", ...)``.

    Returns:
        a :class:`Rollout`; trajectory ``i`` belongs to group ``i // group_size``.

    Raises:
        BackendError: a request failed (training never continues past a failed rollout).
        DataError: see :func:`trajectory_rows`.
    """
    if reward_fn is None:
        from memagent.scoring import score

        def reward_fn(response: str, answers: Sequence[str]) -> float:
            return score("strict_boxed", response, answers)
    for s in samples:
        if not s.has_gold_answer:
            raise DataError(f"sample {s.id} has no gold answers; training needs them for the reward")
    t0 = time.perf_counter()
    repeated = repeat_samples(samples, group_size)
    trajs = agent.run(repeated)
    rows: list[Row] = []
    rewards: list[float] = []
    groups: list[int] = []
    for i, (s, traj) in enumerate(zip(repeated, trajs)):
        if traj.error is not None:
            raise BackendError(f"rollout of {s.id} failed: {traj.error}")
        g = i // group_size
        rows.extend(trajectory_rows(traj, i, g))
        rewards.append(float(reward_fn(traj.response, s.answers)))
        groups.append(g)
    return Rollout(tuple(rows), tuple(rewards), tuple(groups), tuple(trajs), time.perf_counter() - t0)
