"""Rows -> padded tensors, per-token log-probabilities, mini- and micro-batches.

Layout: rows are right-padded to ``(B, T)`` (prompt then response). Log-probabilities, masks and weights
live in *target space* ``(B, T - 1)``: column ``t`` scores token ``input_ids[:, t + 1]`` given the tokens
before it. ``response_mask[b, t] = 1`` when that token is one of row ``b``'s sampled response tokens, so
prompt tokens (question, memory, chunk) are never trained (reference-memagent.md §4.10).

Log-probabilities are computed from the last hidden states in position chunks, so only a ``(B, chunk,
vocab)`` slice of logits exists at a time (with gradient checkpointing of that slice when training).

Source: reference-memagent.md §4.5 (padding), §4.8 (micro-batches by token budget, grad accumulation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from memagent.errors import ConfigError
from memagent.train.precision import adapter_casts_off, compute_autocast, full_precision
from memagent.train.prefix import (  # noqa: F401 - micro_batches re-exported
    PrefixGroup, check_sharing, micro_batches, plan_micro_batches, shared_prefix_hidden,
)
from memagent.train.rollout import Row


@dataclass
class Batch:
    """Padded tensors of some rows.

    Attributes:
        input_ids: ``(B, T)`` prompt + response ids, right-padded with ``pad_id``.
        attention_mask: ``(B, T)`` 1 on real tokens.
        response_mask: ``(B, T-1)`` 1 where the target token is a response token.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor


def decoder(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM (``base_model``, returning hidden states), also through a peft wrapper
    (whose own ``base_model`` is the tuner around the whole LM)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.base_model


def pad_rows(rows: Sequence[Row], pad_id: int) -> Batch:
    """Right-pad rows into a :class:`Batch`.

    Raises:
        ConfigError: no rows, or a row with an empty prompt (nothing to condition the first token on).
    """
    if not rows:
        raise ConfigError("pad_rows needs at least one row")
    width = max(r.num_tokens for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    resp = torch.zeros((len(rows), max(width - 1, 1)), dtype=torch.float32)
    for b, r in enumerate(rows):
        if not r.prompt_ids:
            raise ConfigError(f"row {b} has an empty prompt")
        seq = list(r.prompt_ids) + list(r.response_ids)
        ids[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[b, : len(seq)] = 1
        p = len(r.prompt_ids)
        resp[b, p - 1 : len(seq) - 1] = 1.0
    return Batch(ids, attn, resp)


class TokenLogProbs(nn.Module):
    """Wraps a causal LM so that ``forward`` returns per-token log-probabilities (and entropy).

    Wrap *this* module in DistributedDataParallel (not the bare LM), so gradient synchronisation sees the
    whole computation.

    Args:
        model: a transformers causal LM (``base_model`` + ``get_output_embeddings()``).
        chunk_tokens: positions (over the whole batch) per log-softmax slice.
        checkpoint: recompute each logits slice in backward instead of storing it.
        temperature: the rollouts' sampling temperature; logits are divided by it, so the log-probabilities
            (and entropy) are those of the distribution the response tokens were drawn from (as verl does for
            the actor and the reference model). ``top_p`` truncation is not reflected, as in verl.
        compute_dtype: ``"bfloat16"`` runs the decoder and the output projection under autocast
            (:mod:`memagent.train.precision`); the log-softmax and the returned values stay float32.

    Raises:
        ConfigError: ``temperature <= 0`` or an unknown ``compute_dtype``.
    """

    def __init__(self, model: nn.Module, chunk_tokens: int = 512, checkpoint: bool = True, temperature: float = 1.0,
                 compute_dtype: str = "float32"):
        super().__init__()
        if not temperature > 0:
            raise ConfigError(f"log-probabilities need a sampling temperature > 0, got {temperature}")
        compute_autocast(compute_dtype)  # checks the name
        self.model = model
        self.chunk_tokens = max(1, int(chunk_tokens))
        self.checkpoint = checkpoint
        self.temperature = float(temperature)
        self.compute_dtype = compute_dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        with_entropy: bool = False,
        target_mask: torch.Tensor | None = None,
        groups: Sequence[PrefixGroup] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probabilities of ``input_ids[:, 1:]``.

        Args:
            input_ids, attention_mask: ``(B, T)`` right-padded rows.
            with_entropy: also return the policy entropy at each position (nats).
            target_mask: ``(B, T-1)``; when given, logits are computed only where it is nonzero (the response
                tokens), which saves most of the vocabulary projection for long prompts; other positions are 0.
            groups: shared-prefix groups covering the rows (:func:`memagent.train.prefix.shared_prefix_hidden`):
                each group's common prefix is computed once; the result is the same.

        Returns:
            ``(logp (B, T-1), entropy (B, T-1) or None)`` in float32, on the model's device (the inputs are
            moved there).
        """
        base = decoder(self.model)
        device = self.model.get_input_embeddings().weight.device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        if target_mask is not None:
            target_mask = target_mask.to(device)
        with compute_autocast(self.compute_dtype, device), adapter_casts_off(self.model, self.compute_dtype != "float32"):
            return self._logprobs(base, input_ids, attention_mask, with_entropy, target_mask, groups)

    def _logprobs(self, base, input_ids, attention_mask, with_entropy, target_mask, groups):
        if groups is not None:
            hidden = shared_prefix_hidden(base, input_ids, attention_mask, groups)
        else:
            hidden = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        h, targets = hidden[:, :-1], input_ids[:, 1:]
        if target_mask is None:
            sel = torch.ones(targets.shape, dtype=torch.bool, device=targets.device)
        else:
            sel = target_mask.to(torch.bool)
            if not bool(sel.any()):  # keep a graph (zero-weight position) so backward and DDP still run
                sel = sel.clone()
                sel[0, 0] = True
        hs, ts = h[sel], targets[sel]
        head = self.model.get_output_embeddings()
        outs, ents = [], []
        for s in range(0, hs.shape[0], self.chunk_tokens):
            hc, tc = hs[s : s + self.chunk_tokens], ts[s : s + self.chunk_tokens]
            if self.checkpoint and torch.is_grad_enabled():
                lp, en = torch.utils.checkpoint.checkpoint(_slice_logprobs, head, hc, tc, with_entropy,
                                                           self.temperature, use_reentrant=False)
            else:
                lp, en = _slice_logprobs(head, hc, tc, with_entropy, self.temperature)
            outs.append(lp)
            ents.append(en)
        zeros = torch.zeros(targets.shape, dtype=torch.float32, device=targets.device)
        flat = torch.cat(outs) if outs else zeros.new_zeros(0)
        logp = zeros.masked_scatter(sel, flat)
        ent = zeros.masked_scatter(sel, torch.cat(ents) if ents else flat) if with_entropy else None
        return logp, ent


def decoder(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM (``base_model``, returning hidden states), also through a peft wrapper
    (whose own ``base_model`` is the tuner around the whole LM)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.base_model


def _slice_logprobs(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, with_entropy: bool,
                    temperature: float = 1.0):
    logits = head(hidden)
    with full_precision(logits.device):  # the vocabulary softmax in float32 even under bfloat16 autocast
        logits = logits.float()
        logsm = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
        lp = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        if not with_entropy:
            return lp, lp.new_zeros(lp.shape)
        return lp, -(logsm.exp() * logsm).sum(-1)


def split_trajectories(traj_of_row: Sequence[int], num_parts: int) -> list[list[int]]:
    """Split rows into ``num_parts`` near-equal mini-batches of whole trajectories.

    A trajectory is never split, so trajectory-normalised aggregation sees all its tokens. With fewer
    trajectories than parts, some parts are empty (and skipped by the trainer).

    Returns:
        ``num_parts`` lists of row indices.
    """
    trajs = sorted(set(traj_of_row))
    bounds = [round(k * len(trajs) / num_parts) for k in range(num_parts + 1)]
    part_of = {t: k for k in range(num_parts) for t in trajs[bounds[k] : bounds[k + 1]]}
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for i, t in enumerate(traj_of_row):
        parts[part_of[t]].append(i)
    return parts


@torch.no_grad()
def row_logprobs(
    scorer: TokenLogProbs, rows: Sequence[Row], pad_id: int, max_tokens: int, with_entropy: bool = False,
    equal_forwards: Callable[[int], int] | None = None, min_shared_tokens: int | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Log-probabilities (and entropy) of every row's response tokens, without gradient.

    Args:
        scorer: the (possibly FSDP-sharded) :class:`TokenLogProbs`.
        rows: this process's rows.
        pad_id: padding token id.
        max_tokens: padded-token budget per micro-batch.
        with_entropy: also return per-token entropies.
        equal_forwards: under FSDP every process must run the same number of forwards (each one all-gathers
            the parameters): maps this process's micro-batch count to the count all processes run (their
            maximum); the missing ones are forwards on a 2-token dummy row whose output is dropped.
        min_shared_tokens: compute prompt prefixes shared by rows once (:mod:`memagent.train.prefix`), when at
            least this long; ``None``: no sharing.

    Returns:
        per row, a ``(T_resp,)`` float32 CPU tensor aligned with ``row.response_ids``; entropies likewise
        when ``with_entropy``.
    """
    check_sharing(min_shared_tokens, equal_forwards)
    out: list[torch.Tensor] = [torch.empty(0)] * len(rows)
    ents: list[torch.Tensor] = [torch.empty(0)] * len(rows)
    plan = plan_micro_batches([r.prompt_ids for r in rows], [r.num_tokens for r in rows], max_tokens, min_shared_tokens)
    total = equal_forwards(len(plan)) if equal_forwards is not None else len(plan)
    was_training = scorer.training
    scorer.eval()
    try:
        for mb in plan:
            group = mb.rows
            batch = pad_rows([rows[i] for i in group], pad_id)
            extra = {"groups": mb.groups} if mb.groups is not None else {}
            logp, ent = scorer(batch.input_ids, batch.attention_mask, with_entropy, batch.response_mask, **extra)
            for b, i in enumerate(group):
                p, n = len(rows[i].prompt_ids), len(rows[i].response_ids)
                out[i] = logp[b, p - 1 : p - 1 + n].detach().to("cpu", torch.float32, copy=True)
                if ent is not None:
                    ents[i] = ent[b, p - 1 : p - 1 + n].detach().to("cpu", torch.float32, copy=True)
        for _ in range(total - len(plan)):
            scorer(*dummy_batch(pad_id))
    finally:
        scorer.train(was_training)
    return out, (ents if with_entropy else None)


def dummy_batch(pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of one 2-token row: a forward that only keeps FSDP's collectives in step."""
    return torch.full((1, 2), pad_id, dtype=torch.long), torch.ones((1, 2), dtype=torch.long)


def scatter_response(values: Sequence[torch.Tensor], rows: Sequence[Row], width: int) -> torch.Tensor:
    """Place per-row response values (``(T_resp,)`` each) into target space ``(B, width)``, zero elsewhere."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for b, (v, r) in enumerate(zip(values, rows)):
        p = len(r.prompt_ids)
        out[b, p - 1 : p - 1 + len(v)] = v
    return out
