"""Training rows built without a rollout engine: real template renderings, synthetic memories.

For update benchmarks and tests: each row's prompt ids are exactly what the memory agent would send (the
chat template around :class:`memagent.agent.prompts.PromptTemplates`, chunks cut by
:func:`memagent.chunking.chunk_text`), and the memory written at each step (the response) is seeded filler of
about ``memory_tokens`` tokens that the next prompt shows, as in a real trajectory. Only the words of the
memories are made up, so prefix sharing, lengths and padding match a real rollout of the same shape.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from memagent.agent.prompts import DEFAULT_TEMPLATES, PromptTemplates
from memagent.chunking import chunk_text
from memagent.train.rollout import Row
from memagent.types import Sample

_WORDS = ("the", "number", "for", "is", "section", "notes", "key", "value", "mentioned", "apple", "river", "found",
          "no", "relevant", "facts", "yet", "special", "magic", "document", "question", "answer", "keep", "earlier")


def chunk_first_templates() -> PromptTemplates:
    """The builtin ``chunk_first`` templates (``agent/templates/chunk_first.yaml``: problem, section, memory), so
    the G rollouts of a question share the instruction, question and chunk as a prompt prefix."""
    return PromptTemplates.from_file("chunk_first")


def _memory_ids(chat, rng: random.Random, tokens: int) -> list[int]:
    words = " ".join(rng.choice(_WORDS) for _ in range(tokens * 2))
    return chat.tokenizer.encode(words)[:tokens]


def synthetic_rows(chat, samples: Sequence[Sample], group_size: int, chunk_tokens: int, memory_tokens: int,
                   final_tokens: int = 16, templates: PromptTemplates | None = None, seed: int = 0) -> list[Row]:
    """Rows of ``group_size`` trajectories per sample, trajectory-major and turns in order (as a rollout).

    Args:
        chat: a :class:`memagent.backends.hf.ChatTokens` (the model's chat template and tokenizer).
        samples: the questions and documents.
        group_size: G, trajectories per question.
        chunk_tokens: document tokens per chunk.
        memory_tokens: tokens of each written memory (the update's response, plus the stop token).
        final_tokens: tokens of the final answer's response (plus the stop token).
        templates: the prompts (default: the built-in ones).
        seed: seeds the memories' words (trajectory ``j`` of a question writes other words than ``j + 1``).

    Returns:
        rows of ``len(samples) x G`` trajectories; trajectory ``i`` is in group ``i // G``.
    """
    tpl = templates or DEFAULT_TEMPLATES
    stop = chat.stop_ids[0]
    rows: list[Row] = []
    for q, s in enumerate(samples):
        chunks = chunk_text(s.context, chat.tokenizer, chunk_tokens)
        for j in range(group_size):
            traj = q * group_size + j
            rng = random.Random(f"{seed}/{s.id}/{j}")
            memory = None
            for c in chunks:
                prompt = chat.prompt_ids(tpl.messages_update(s.question, memory, c.text))
                resp = _memory_ids(chat, rng, memory_tokens)
                rows.append(Row(tuple(prompt), tuple(resp) + (stop,), traj, q, False))
                memory = chat.tokenizer.decode(resp)
            prompt = chat.prompt_ids(tpl.messages_final(s.question, memory))
            answer = chat.tokenizer.encode(f"The answer is \\boxed{{{s.answers[0]}}}.")[:final_tokens]
            rows.append(Row(tuple(prompt), tuple(answer) + (stop,), traj, q, True))
    return rows
