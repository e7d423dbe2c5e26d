"""Shared-prefix groups in the update: compute a prompt prefix common to several rows once.

The G rollouts of a question read the same chunk at each step, so with a template that puts the chunk before
the memory (problem, section, memory) their rows at chunk ``k`` begin with the same long run of prompt
tokens; with the default template (problem, memory, section) all rows of a question still share the
instruction and the question. :func:`find_prefix_groups` finds such groups from the rows' own token ids
(longest common prefix among rows; a group must share at least ``min_shared_tokens``), and
:func:`shared_prefix_hidden` runs each group as one prefix forward at batch 1 whose keys and values are
repeated for the group's rows, then one forward of the rows' suffixes that attends to them (position ids
continue after the prefix; right padding is masked). Gradients flow through the repeated keys and values
into the prefix computation, so the result and its gradient equal the unshared forward's (tested to 1e-5).

A shared prefix always stops at least one token before the shortest prompt of its group, so every scored
position (the last prompt token onwards) lies in the suffix.

Limits: not under gradient checkpointing (transformers drops the cache of a checkpointed layer, which would
silently cut the suffix off its prefix: refused) and not under FSDP (ranks would run different numbers of
per-layer forwards). With LoRA dropout > 0 a group's prefix shares one dropout mask.

Source: the per-chunk prompt structure of MemAgent rollouts (reference-memagent.md §4.4); the saving is
``(rows - 1) x prefix`` tokens per group.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from memagent.errors import ConfigError


@dataclass(frozen=True)
class PrefixGroup:
    """Rows that share their first ``prefix_tokens`` prompt tokens.

    Attributes:
        rows: indices of the rows (into the list the group was found in, or into a micro-batch).
        prefix_tokens: shared tokens, computed once; 0 means the rows run unshared (plain padded forward).
    """

    rows: tuple[int, ...]
    prefix_tokens: int


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward of a mini-batch.

    Attributes:
        rows: indices into the mini-batch's rows, in the order they are padded.
        groups: the prefix groups with indices into ``rows`` (local), or ``None`` for one plain forward.
    """

    rows: tuple[int, ...]
    groups: tuple[PrefixGroup, ...] | None


def common_prefix_tokens(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


def find_prefix_groups(prompts: Sequence[Sequence[int]], min_shared_tokens: int) -> list[PrefixGroup]:
    """Partition rows into prefix groups that save the most recomputed tokens.

    Rows are sorted by their prompt ids, so rows with a common prefix are neighbours, and the sorted order is
    cut into runs by dynamic programming: a run of ``n`` rows whose common prefix is ``L`` tokens (capped at
    each prompt's length - 1) saves ``(n - 1) * L`` tokens when ``L >= min_shared_tokens``; other rows stay
    unshared. With a chunk-first template the best runs are the G rows that read the same chunk; with the
    default template, all rows of a question (they share the instruction and question).

    Args:
        prompts: each row's prompt ids.
        min_shared_tokens: smallest prefix worth sharing (a prefix forward has a fixed cost).

    Returns:
        groups covering every row once: shared groups (``prefix_tokens >= min_shared_tokens``, 2+ rows) in
        sorted order, then one group with ``prefix_tokens=0`` holding the unshared rows (if any).

    Raises:
        ConfigError: ``min_shared_tokens < 1``.
    """
    if min_shared_tokens < 1:
        raise ConfigError(f"the shared-prefix minimum must be >= 1 token, got {min_shared_tokens}")
    order = sorted(range(len(prompts)), key=lambda i: tuple(prompts[i]))
    cap = [len(prompts[i]) - 1 for i in order]
    adj = [common_prefix_tokens(prompts[order[k]], prompts[order[k + 1]]) for k in range(len(order) - 1)]
    n = len(order)
    best = [0] * (n + 1)  # best[k]: most tokens saved over the first k sorted rows
    cut: list[tuple[int, int]] = [(0, 0)] * (n + 1)  # (start of the last run, its prefix) for best[k]
    for k in range(1, n + 1):
        best[k], cut[k] = best[k - 1], (k - 1, 0)
        shared = cap[k - 1]
        for i in range(k - 2, -1, -1):  # run order[i:k]; its common prefix only shrinks as i decreases
            shared = min(shared, adj[i], cap[i])
            if shared < min_shared_tokens:
                break
            gain = best[i] + (k - 1 - i) * shared
            if gain > best[k]:
                best[k], cut[k] = gain, (i, shared)
    groups, alone, k = [], [], n
    while k > 0:
        i, shared = cut[k]
        if shared:
            groups.append(PrefixGroup(tuple(sorted(order[i:k])), shared))
        else:
            alone.append(order[k - 1])
        k = i
    groups.reverse()
    if alone:
        groups.append(PrefixGroup(tuple(sorted(alone)), 0))
    return groups


def micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group consecutive rows so that each group's padded size (rows x longest row) stays within
    ``max_tokens``; a row longer than the budget forms a group of its own.

    Args:
        lengths: tokens of each row (prompt + response).
        max_tokens: padded-token budget per micro-batch.

    Returns:
        lists of row indices, covering ``range(len(lengths))`` in order.

    Raises:
        ConfigError: ``max_tokens < 1``.
    """
    if max_tokens < 1:
        raise ConfigError(f"micro-batch token budget must be >= 1, got {max_tokens}")
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if cur and (len(cur) + 1) * max(longest, n) > max_tokens:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        groups.append(cur)
    return groups


def plan_micro_batches(prompts: Sequence[Sequence[int]], lengths: Sequence[int], max_tokens: int,
                       min_shared_tokens: int | None = None) -> list[MicroBatch]:
    """Micro-batches of whole prefix groups within a token budget.

    Without sharing (``min_shared_tokens=None``) this is :func:`micro_batches` (rows in
    order, padded size ``rows x longest <= max_tokens``), with ``groups=None``. With sharing, a shared group
    costs ``prefix + rows x longest suffix`` tokens and unshared rows ``rows x longest``; groups are packed
    greedily in order, and a group over the budget is split into smaller groups with the same prefix (each
    computes it once).

    Args:
        prompts: each row's prompt ids.
        lengths: each row's tokens (prompt + response).
        max_tokens: token budget per micro-batch.
        min_shared_tokens: see :func:`find_prefix_groups`; ``None`` turns sharing off.

    Returns:
        micro-batches covering every row once.
    """
    if min_shared_tokens is None:
        return [MicroBatch(tuple(g), None) for g in micro_batches(lengths, max_tokens)]
    units: list[PrefixGroup] = []
    for g in find_prefix_groups(prompts, min_shared_tokens):
        if g.prefix_tokens == 0:
            units.extend(PrefixGroup((i,), 0) for i in g.rows)
            continue
        longest = max(lengths[i] for i in g.rows) - g.prefix_tokens
        per = max(1, (max_tokens - g.prefix_tokens) // max(longest, 1))
        units.extend(PrefixGroup(g.rows[s : s + per], g.prefix_tokens) for s in range(0, len(g.rows), per))
    out: list[MicroBatch] = []
    cur: list[PrefixGroup] = []

    def cost(units_: list[PrefixGroup]) -> int:
        plain = [lengths[i] for u in units_ if u.prefix_tokens == 0 for i in u.rows]
        shared = sum(u.prefix_tokens + len(u.rows) * (max(lengths[i] for i in u.rows) - u.prefix_tokens)
                     for u in units_ if u.prefix_tokens)
        return shared + len(plain) * max(plain, default=0)

    for u in units:
        if cur and cost(cur + [u]) > max_tokens:
            out.append(_micro_batch(cur))
            cur = []
        cur.append(u)
    if cur:
        out.append(_micro_batch(cur))
    return out


def _micro_batch(units: list[PrefixGroup]) -> MicroBatch:
    rows = tuple(i for u in units for i in u.rows)
    pos = {r: k for k, r in enumerate(rows)}
    shared = [PrefixGroup(tuple(pos[i] for i in u.rows), u.prefix_tokens) for u in units if u.prefix_tokens]
    plain = tuple(pos[i] for u in units if not u.prefix_tokens for i in u.rows)
    return MicroBatch(rows, tuple(shared) + ((PrefixGroup(plain, 0),) if plain else ()))


def check_sharing(min_shared_tokens: int | None, equal_forwards: object | None) -> None:
    """Refuse shared prefixes under FSDP (``equal_forwards`` set): a group runs two forwards of every layer,
    and ranks with different groupings would pair up different per-layer all-gathers.

    Raises:
        ConfigError: both are set.
    """
    if min_shared_tokens is not None and equal_forwards is not None:
        raise ConfigError("shared prefixes are not supported under FSDP (run.distributed=fsdp); turn sharing off "
                          "or use run.distributed=ddp")


def shared_prefix_hidden(decoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         groups: Sequence[PrefixGroup]) -> torch.Tensor:
    """Last hidden states of right-padded rows, computing each group's shared prefix once.

    Each shared group runs its prefix (taken from its first row) at batch 1 with a key/value cache, repeats the
    cache for its rows (``DynamicCache.batch_repeat_interleave``, differentiable), then runs the rows' suffixes
    with position ids continuing at the prefix length and an attention mask over prefix + suffix. The prefix's
    hidden states are repeated into each row. Unshared rows (``prefix_tokens=0``) run as one padded forward.

    Args:
        decoder: the decoder stack (a transformers ``base_model`` such as ``LlamaModel``).
        input_ids, attention_mask: ``(B, T)`` right-padded rows.
        groups: cover every row once; a shared group's rows must agree on their first ``prefix_tokens`` ids.

    Returns:
        ``(B, T, H)`` hidden states, equal to ``decoder(input_ids, attention_mask).last_hidden_state`` at every
        real token (padding positions may differ).

    Raises:
        ConfigError: gradient checkpointing is on while training, or a group's rows do not share the prefix.
    """
    if torch.is_grad_enabled() and decoder.training and any(getattr(m, "gradient_checkpointing", False)
                                                            for m in decoder.modules()):
        raise ConfigError("shared prefixes cannot run under gradient checkpointing (transformers drops the key/value "
                          "cache of checkpointed layers); set model.gradient_checkpointing=false or turn sharing off")
    B, T = input_ids.shape
    lengths = attention_mask.sum(-1).tolist()
    parts: dict[int, torch.Tensor] = {}
    for g in groups:
        idx = list(g.rows)
        width = max(int(lengths[i]) for i in idx)
        ids, mask = input_ids[idx, :width], attention_mask[idx, :width]
        if g.prefix_tokens == 0:
            h = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        else:
            h = _group_hidden(decoder, ids, mask, g.prefix_tokens)
        for b, i in enumerate(idx):
            parts[i] = h[b]
    if sorted(parts) != list(range(B)):
        raise ConfigError(f"prefix groups must cover the {B} rows of the batch once each")
    rows = [torch.nn.functional.pad(parts[i], (0, 0, 0, T - parts[i].shape[0])) for i in range(B)]
    return torch.stack(rows)


def _group_hidden(decoder: nn.Module, ids: torch.Tensor, mask: torch.Tensor, prefix: int) -> torch.Tensor:
    """``(n, width, H)`` hidden states of ``n`` rows sharing their first ``prefix`` ids."""
    n, width = ids.shape
    if not bool((ids[:, :prefix] == ids[:1, :prefix]).all()) or not bool(mask[:, :prefix].all()):
        raise ConfigError(f"the rows of a prefix group do not share their first {prefix} tokens")
    if prefix >= width:
        raise ConfigError(f"a shared prefix ({prefix} tokens) must be shorter than its rows ({width} tokens)")
    out = decoder(input_ids=ids[:1, :prefix], attention_mask=mask[:1, :prefix], use_cache=True)
    cache = out.cache if getattr(out, "cache", None) is not None else out.past_key_values
    cache.batch_repeat_interleave(n)
    positions = torch.arange(prefix, width, device=ids.device).unsqueeze(0).expand(n, -1)
    suffix = decoder(input_ids=ids[:, prefix:], attention_mask=mask, position_ids=positions, use_cache=True,
                     **{_cache_kwarg(decoder): cache}).last_hidden_state
    return torch.cat([out.last_hidden_state.expand(n, -1, -1), suffix], dim=1)


def _cache_kwarg(decoder: nn.Module) -> str:
    """The decoder's name for its key/value cache argument: ``cache`` (transformers >= 5.2x) or
    ``past_key_values`` (earlier)."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
