import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memagent.errors import ConfigError  # noqa: E402
from memagent.rl.losses import AGG_MODES  # noqa: E402
from memagent.train.batching import (  # noqa: E402
    TokenLogProbs, micro_batches, pad_rows, row_logprobs, scatter_response, split_trajectories,
)
from memagent.train.rollout import Row  # noqa: E402
from memagent.train.update import LossSettings, mini_batch_backward  # noqa: E402



pytestmark = pytest.mark.usefixtures("one_torch_thread")




def _rows():
    g = torch.Generator().manual_seed(3)
    spec = [(5, 3, 0, False), (4, 6, 0, True), (9, 2, 1, False), (3, 1, 1, False), (6, 4, 1, True), (7, 5, 2, True)]
    rows = []
    for p, r, t, f in spec:
        ids = torch.randint(3, 300, (p + r,), generator=g).tolist()
        rows.append(Row(tuple(ids[:p]), tuple(ids[p:]), t, 0 if t < 2 else 1, f))
    return rows


def test_pad_rows_layout():
    b = pad_rows([Row((7, 8), (9,), 0, 0, True), Row((4,), (5, 6, 2), 1, 0, True)], pad_id=0)
    assert b.input_ids.tolist() == [[7, 8, 9, 0], [4, 5, 6, 2]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    # target t scores input t+1: row 0 trains token 9 (target col 1); row 1 trains 5, 6, 2 (cols 0..2)
    assert b.response_mask.tolist() == [[0, 1, 0], [1, 1, 1]]
    with pytest.raises(ConfigError, match="empty prompt"):
        pad_rows([Row((), (1,), 0, 0, True)], 0)


def test_micro_batches_and_splits():
    assert micro_batches([4, 4, 4, 10, 2], 12) == [[0, 1, 2], [3], [4]]
    assert micro_batches([3, 5], 10) == [[0, 1]]
    assert micro_batches([20], 5) == [[0]]
    assert split_trajectories([0, 0, 1, 1, 1, 2, 3], 2) == [[0, 1, 2, 3, 4], [5, 6]]
    assert split_trajectories([0, 1], 3) == [[0], [], [1]]


def test_logprobs_match_full_logits_and_chunking(tiny):
    model, _ = tiny
    rows = _rows()
    b = pad_rows(rows, 0)
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float()
        ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)
        lp, ent = TokenLogProbs(model, chunk_tokens=3)(b.input_ids, b.attention_mask, with_entropy=True)
    m = b.response_mask.bool()
    torch.testing.assert_close(lp[m], ref[m], atol=1e-5, rtol=1e-5)
    p = torch.softmax(logits[:, :-1], -1)
    torch.testing.assert_close(ent[m], -(p * p.log()).sum(-1)[m], atol=1e-4, rtol=1e-4)
    per_row, _ = row_logprobs(TokenLogProbs(model, 4), rows, 0, max_tokens=20)
    assert [len(x) for x in per_row] == [len(r.response_ids) for r in rows]
    torch.testing.assert_close(scatter_response(per_row, rows, lp.shape[1])[m], ref[m], atol=1e-5, rtol=1e-5)


def _grads(model, rows, settings, micro_tokens):
    model.zero_grad(set_to_none=True)
    scorer = TokenLogProbs(model, chunk_tokens=4)
    old, _ = row_logprobs(scorer, rows, 0, 1000)
    old = [o - 0.05 * (i % 3) for i, o in enumerate(old)]  # ratios != 1 so clipping matters
    ref = [o + 0.1 for o in old]
    adv = torch.tensor([0.5, 0.5, -1.0, -1.0, -1.0, 2.0])
    m = mini_batch_backward(scorer, rows, adv, old, ref, settings, 0, micro_tokens)
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone(), m


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_reproduce_one_big_batch(tiny, mode):
    model, _ = tiny
    rows = _rows()
    s = LossSettings(agg_mode=mode, kl_coef=0.01, entropy_coef=0.001, horizon_tokens=8, clip_low=0.01, clip_high=0.02)
    big, mb = _grads(model, rows, s, micro_tokens=10_000)
    small, ms = _grads(model, rows, s, micro_tokens=12)
    torch.testing.assert_close(small, big, atol=1e-6, rtol=1e-5)
    assert ms["loss"] == pytest.approx(mb["loss"], abs=1e-6)
    assert ms["pg/clip_frac"] == pytest.approx(mb["pg/clip_frac"], abs=1e-6)
    assert mb["tokens"] == sum(len(r.response_ids) for r in rows)


def test_mask_final_trains_only_updates(tiny):
    model, _ = tiny
    rows = [r for r in _rows() if r.traj_index == 0]
    s = LossSettings(mask_final=True, kl_coef=0.0)
    g_all, m = _grads(model, rows, s, 10_000)
    g_upd, _ = _grads(model, rows[:1], LossSettings(kl_coef=0.0), 10_000)
    torch.testing.assert_close(g_all, g_upd, atol=1e-7, rtol=1e-5)
    assert m["tokens"] == len(rows[0].response_ids)


def test_all_masked_micro_batch_still_backpropagates(tiny):
    model, _ = tiny
    rows = [r for r in _rows() if r.traj_index == 1]
    model.zero_grad(set_to_none=True)
    scorer = TokenLogProbs(model, chunk_tokens=4)
    old, _ = row_logprobs(scorer, rows, 0, 1000)
    only_final = [Row(r.prompt_ids, r.response_ids, r.traj_index, r.group_id, True) for r in rows[:1]]
    s = LossSettings(mask_final=True, kl_coef=0.0)
    m = mini_batch_backward(scorer, only_final, torch.tensor([1.0]), old[:1], None, s, 0, 10_000)
    assert m["tokens"] == 0 and m["loss"] == 0.0
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(float(g.abs().sum()) == 0.0 for g in grads)


def test_on_policy_shortcut_matches_explicit_old_logprobs(tiny):
    model, _ = tiny
    rows = _rows()
    scorer = TokenLogProbs(model, chunk_tokens=4)
    adv = torch.tensor([0.5, 0.5, -1.0, -1.0, -1.0, 2.0])
    s = LossSettings(kl_coef=0.0)
    grads = []
    for use_old in (True, False):
        model.zero_grad(set_to_none=True)
        old = row_logprobs(scorer, rows, 0, 1000)[0] if use_old else None
        m = mini_batch_backward(scorer, rows, adv, old, None, s, 0, 12, log_entropy=True)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone())
        assert m["pg/ratio_mean"] == pytest.approx(1.0, abs=1e-5) and m["entropy/mean"] > 0
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)


class _CountingScorer(TokenLogProbs):
    """Counts forwards and the widths of their batches."""

    def __init__(self, model):
        super().__init__(model, chunk_tokens=4)
        self.widths: list[int] = []

    def forward(self, input_ids, *args, **kwargs):
        self.widths.append(input_ids.shape[1])
        return super().forward(input_ids, *args, **kwargs)


def test_equal_forwards_pad_with_dummy_rows_that_change_nothing(tiny):
    # FSDP keeps ranks in step by running the same number of forwards; the extra ones are 2-token dummies
    model, _ = tiny
    rows = _rows()
    s = LossSettings(kl_coef=0.01, entropy_coef=0.001)
    plain = _CountingScorer(model)
    old, _ = row_logprobs(plain, rows, 0, 24)
    n = len(plain.widths)
    assert n == len(micro_batches([r.num_tokens for r in rows], 24)) == 3  # lengths 8,10 | 11,4 | 10,12
    padded = _CountingScorer(model)
    asked = []
    old_p, _ = row_logprobs(padded, rows, 0, 24, equal_forwards=lambda k: asked.append(k) or k + 3)
    assert asked == [3] and padded.widths[:n] == plain.widths and padded.widths[n:] == [2, 2, 2]
    assert all(torch.equal(a, b) for a, b in zip(old, old_p))
    adv = torch.tensor([0.5, 0.5, -1.0, -1.0, -1.0, 2.0])
    model.zero_grad(set_to_none=True)
    ref = [o + 0.1 for o in old]
    m1 = mini_batch_backward(plain, rows, adv, old, ref, s, 0, 24)
    g1 = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    padded.widths.clear()
    m2 = mini_batch_backward(padded, rows, adv, old, ref, s, 0, 24, equal_forwards=lambda k: k + 2)
    assert padded.widths[n:] == [2, 2]
    for a, b in zip(g1, (p.grad for p in model.parameters())):
        torch.testing.assert_close(b, a, atol=0, rtol=0)
    assert m2 == m1


def test_logprobs_at_the_sampling_temperature(tiny):
    # the rows were sampled from softmax(logits / T): their log-probabilities and entropy are taken there too
    model, _ = tiny
    rows = _rows()
    b = pad_rows(rows, 0)
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits.float()[:, :-1] / 0.5
        ref = torch.log_softmax(logits, -1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)
        lp, ent = TokenLogProbs(model, chunk_tokens=3, temperature=0.5)(b.input_ids, b.attention_mask, True)
        lp1, _ = TokenLogProbs(model, chunk_tokens=3)(b.input_ids, b.attention_mask)
    m = b.response_mask.bool()
    torch.testing.assert_close(lp[m], ref[m], atol=1e-5, rtol=1e-5)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(ent[m], -(p * p.log()).sum(-1)[m], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(lp1[m], lp[m])
    with pytest.raises(ConfigError, match="temperature > 0"):
        TokenLogProbs(model, temperature=0)
