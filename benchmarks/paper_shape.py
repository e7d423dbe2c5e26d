"""Tokens per GRPO step at the 7B recipe's shape, with and without shared prefixes (arithmetic, no model).

    python benchmarks/paper_shape.py                      # the reference recipe: chunk 5000, memory 1024, G 16, 128 prompts
    python benchmarks/paper_shape.py --chunks 4 --group 8 # another shape

Counts, per training step, (a) the prompt tokens the rollouts prefill and (b) the row tokens the update's
forward passes see (prompt + response of every conversation), for three layouts:

- unshared: every conversation computed on its own (the reference's rollouts without a prefix cache, and its
  update, which expands each trajectory into one row per conversation);
- shared, reference order (problem, memory, section): the G rollouts of a question share the instruction and
  question at every chunk, and their whole first prompt (the memory is still the no-memory marker);
- shared, chunk first (problem, section, memory; ``templates: chunk_first``): they share the instruction,
  question and the whole chunk at every step.

Upper-bound lengths: every memory and every update response is ``memory`` tokens long (the cap), the final
answer ``answer`` tokens. Template and question lengths are parameters (defaults measured with the
Qwen2.5 tokenizer's chat template are of this order; they change the result little).
Source: reference-memagent.md §4.1 (chunk 5000, memory 1024, rollout.n 16, train_batch_size 128, documents of
~28K tokens = 6 chunks).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """One step's shape. All lengths in tokens.

    Attributes:
        chunks: chunks per document (K update conversations + 1 final per trajectory).
        chunk: chunk length. memory: memory cap = update response length. answer: final response length.
        group: rollouts per question (G). prompts: questions per step.
        template: instruction and chat-template tokens of an update prompt. final_template: of the final prompt.
        question: question length. marker: the no-memory marker's length.
    """

    chunks: int = 6
    chunk: int = 5000
    memory: int = 1024
    answer: int = 32
    group: int = 16
    prompts: int = 128
    template: int = 160
    final_template: int = 100
    question: int = 40
    marker: int = 4


def per_question(s: Shape) -> dict[str, int]:
    """Prefill and row tokens of one question's G trajectories, per layout.

    Returns:
        ``{"prefill/unshared", "prefill/reference", "prefill/chunk_first", "rows/unshared", "rows/reference",
        "rows/chunk_first"}`` in tokens.
    """
    g, head, fhead = s.group, s.template + s.question, s.final_template + s.question
    first_prompt = head + s.marker + s.chunk  # memory is the marker: identical for the G rollouts
    later_prompt = head + s.memory + s.chunk
    final_prompt = fhead + s.memory
    k_later = s.chunks - 1
    unshared_prefill = g * (first_prompt + k_later * later_prompt + final_prompt)
    unshared_rows = unshared_prefill + g * (s.chunks * s.memory + s.answer)
    # shared prefix computed once per group; each rollout adds its own suffix
    ref_prefill = first_prompt + k_later * (head + g * (s.memory + s.chunk)) + fhead + g * s.memory
    cf_prefill = first_prompt + k_later * (head + s.chunk + g * s.memory) + fhead + g * s.memory
    responses = g * (s.chunks * s.memory + s.answer)
    return {"prefill/unshared": unshared_prefill, "prefill/reference": ref_prefill, "prefill/chunk_first": cf_prefill,
            "rows/unshared": unshared_rows, "rows/reference": ref_prefill + responses,
            "rows/chunk_first": cf_prefill + responses}


def main() -> None:
    """Print the table of docs/training.md ("At the 7B recipe's shape")."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in Shape().__dict__.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    s = Shape(**vars(ap.parse_args()))
    q = per_question(s)
    print(f"shape: {s}")
    print("| layout | prefill tokens/step | vs unshared | update row tokens/step | vs unshared |")
    print("|---|---|---|---|---|")
    for layout in ("unshared", "reference", "chunk_first"):
        p, r = q[f"prefill/{layout}"] * s.prompts, q[f"rows/{layout}"] * s.prompts
        print(f"| {layout} | {p / 1e6:.1f}M | {q['prefill/unshared'] / q[f'prefill/{layout}']:.2f}x fewer | "
              f"{r / 1e6:.1f}M | {q['rows/unshared'] / q[f'rows/{layout}']:.2f}x fewer |")


if __name__ == "__main__":
    main()
