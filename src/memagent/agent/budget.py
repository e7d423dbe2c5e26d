"""What a budget error suggests when a memory-agent call cannot fit the context window
(:meth:`memagent.agent.loop.MemoryAgent.check_budget`): the settings to lower, and by how much."""

from __future__ import annotations

from collections.abc import Mapping

from memagent.agent.config import AgentConfig

#: How a budget error names the settings to change, on the command line.
CLI_SETTING_NAMES = {"chunk_tokens": "--chunk-tokens", "memory_tokens": "--memory-tokens",
                     "final_tokens": "--final-tokens", "window": "--n-ctx"}


def budget_fixes(call: str, over: int, need: int, question: int, c: AgentConfig, mem_in: int, no_memory: int,
                 names: Mapping[str, str]) -> list[str]:
    """The ways to make a call fit, each a phrase naming the setting and the value that fits.

    Args:
        call: ``"update"`` or ``"final"``.
        over: tokens by which the call exceeds the window (``need - window``).
        need: tokens the call needs in all.
        question: tokens of the question.
        c: the agent settings.
        mem_in: tokens the memory takes in the prompt (its cap, or the no-memory marker when longer).
        no_memory: tokens of the no-memory marker.
        names: how to name ``chunk_tokens``, ``memory_tokens``, ``final_tokens`` and ``window``.

    Suggested values are never higher than the current ones; "lower both" appears only when no single setting
    is enough.
    """
    window = need - over
    fixes = []
    if question > window // 2:
        fixes.append(f"shorten the question (it alone is {question} tokens)")
    if call == "update":
        if c.chunk_tokens - over >= 1:
            fixes.append(f"lower {names['chunk_tokens']} to at most {c.chunk_tokens - over}")
        mem_max = (window - (need - 2 * c.memory_tokens)) // 2
        if mem_max >= 1:
            fixes.append(f"lower {names['memory_tokens']} to at most {mem_max} (it counts twice: memory in, memory out)")
        room = window - (need - c.chunk_tokens - mem_in - c.memory_tokens)  # for chunk + memory in/out
        mem = max(1, min(c.memory_tokens, room // 4))  # never a higher cap than the one given
        chunk = min(c.chunk_tokens, room - max(mem, no_memory) - mem)
        if chunk >= 1 and c.chunk_tokens - over < 1 and mem_max < 1:  # no single setting is enough
            fixes.append(f"lower both, e.g. {names['chunk_tokens']} {chunk} {names['memory_tokens']} {mem}")
    else:
        if c.final_tokens - over >= 1:
            fixes.append(f"lower {names['final_tokens']} to at most {c.final_tokens - over}")
        fixes.append(f"lower {names['memory_tokens']}")
    fixes.append(f"use a model with a larger context window ({names['window']})")
    return fixes
