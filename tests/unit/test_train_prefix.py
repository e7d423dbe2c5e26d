"""Shared-prefix groups: grouping from the rows' ids, micro-batch plans, and equality with the unshared update."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memagent.errors import ConfigError  # noqa: E402
from memagent.train.batching import TokenLogProbs, micro_batches, pad_rows, row_logprobs  # noqa: E402
from memagent.train.prefix import (  # noqa: E402
    MicroBatch, PrefixGroup, common_prefix_tokens, find_prefix_groups, plan_micro_batches, shared_prefix_hidden,
)
from memagent.train.rollout import Row  # noqa: E402
from memagent.train.tiny import make_tiny_model  # noqa: E402
from memagent.train.update import LossSettings, mini_batch_backward  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_groups_maximise_the_saved_tokens():
    a, b, c, d, e = [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 9, 9], [1, 2, 3, 8, 8, 8], [5, 5, 5], [1, 2, 3, 4, 5, 6, 0]
    # sorted: e a b c d; neighbour prefixes 6, 5, 3, 0. {e,a,b} saves 2 x 5 = 10, {e,a,b,c} 3 x 3 = 9,
    # {e,a} + {b,c} 6 + 3 = 9
    assert find_prefix_groups([a, b, c, d, e], 3) == [PrefixGroup((0, 1, 4), 5), PrefixGroup((2, 3), 0)]
    assert find_prefix_groups([a, b, c, d, e], 6) == [PrefixGroup((0, 4), 6), PrefixGroup((1, 2, 3), 0)]
    # a prefix stops one token before the shortest prompt: [1,2,3] and [1,2,3,4] share 2 tokens, not 3
    assert find_prefix_groups([[1, 2, 3], [1, 2, 3, 4]], 2) == [PrefixGroup((0, 1), 2)]
    assert find_prefix_groups([[1, 2, 3], [1, 2, 3, 4]], 3) == [PrefixGroup((0, 1), 0)]
    assert find_prefix_groups([], 4) == []
    with pytest.raises(ConfigError, match=">= 1 token"):
        find_prefix_groups([a], 0)


def test_plans_hold_whole_groups_within_the_budget():
    lengths = [4, 4, 4, 10, 2]
    assert plan_micro_batches([[1]] * 5, lengths, 12) == [MicroBatch(tuple(g), None) for g in micro_batches(lengths, 12)]
    prompts = [[7] * 10 + [k] for k in range(4)] + [[1, 2]]  # 4 rows share 10 tokens; one row alone
    lengths = [15, 14, 15, 13, 6]
    # one group: 10 + 4 x 5 = 30 tokens; with the lone row (6) over a budget of 35
    assert plan_micro_batches(prompts, lengths, 35, 4) == [
        MicroBatch((0, 1, 2, 3), (PrefixGroup((0, 1, 2, 3), 10),)), MicroBatch((4,), (PrefixGroup((0,), 0),))]
    # budget 20: the group is split in two (10 + 2 x 5 each), each computes the prefix
    assert plan_micro_batches(prompts, lengths, 20, 4) == [
        MicroBatch((0, 1), (PrefixGroup((0, 1), 10),)), MicroBatch((2, 3), (PrefixGroup((0, 1), 10),)),
        MicroBatch((4,), (PrefixGroup((0,), 0),))]
    # room for all: shared group and the unshared row in one micro-batch (30 + 6)
    assert plan_micro_batches(prompts, lengths, 100, 4) == [
        MicroBatch((0, 1, 2, 3, 4), (PrefixGroup((0, 1, 2, 3), 10), PrefixGroup((4,), 0)))]


def _group_rows():
    """Two groups of 3 rows with 12 and 9 shared prompt tokens (different suffix and response lengths, so the
    suffixes are right-padded), and two rows that share nothing."""
    g = torch.Generator().manual_seed(11)
    rand = lambda n: torch.randint(3, 300, (n,), generator=g).tolist()  # noqa: E731
    rows = []
    for q, (shared, tails) in enumerate([(12, [(3, 4), (5, 2), (1, 6)]), (9, [(2, 3), (4, 4), (6, 1)])]):
        head = rand(shared)
        for j, (p, r) in enumerate(tails):
            rows.append(Row(tuple(head + rand(p)), tuple(rand(r)), 3 * q + j, q, j == 2))
    rows.append(Row(tuple(rand(7)), tuple(rand(3)), 6, 2, True))
    rows.append(Row(tuple(rand(5)), tuple(rand(5)), 7, 2, True))
    return rows


class _TokenCount:
    """Counts the tokens the decoder's embedding sees."""

    def __init__(self, model):
        self.n = 0
        model.get_input_embeddings().register_forward_hook(lambda m, i, o: setattr(self, "n", self.n + i[0].numel()))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_shared_hidden_states_and_logprobs_equal_the_unshared(tiny, dtype):
    _, tok = tiny
    model = make_tiny_model(tok, seed=2).to(dtype)
    rows = _group_rows()
    groups = find_prefix_groups([r.prompt_ids for r in rows], 4)
    assert sorted((g.rows, g.prefix_tokens) for g in groups) == [((0, 1, 2), 12), ((3, 4, 5), 9), ((6, 7), 0)]
    b = pad_rows(rows, 0)
    with torch.no_grad():
        want = model.model(input_ids=b.input_ids, attention_mask=b.attention_mask).last_hidden_state
        got = shared_prefix_hidden(model.model, b.input_ids, b.attention_mask, groups)
    real = b.attention_mask.bool()
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got[real], want[real], atol=tol, rtol=tol)
    count = _TokenCount(model)
    plain, _ = row_logprobs(TokenLogProbs(model, 4), rows, 0, 1000, with_entropy=True)
    n_plain, count.n = count.n, 0
    shared, _ = row_logprobs(TokenLogProbs(model, 4), rows, 0, 1000, with_entropy=True, min_shared_tokens=4)
    # padded tokens through the decoder: 8 rows x 19 unshared; shared: 12 + 3 x 7, 9 + 3 x 8, 2 x 10
    assert (n_plain, count.n) == (8 * 19, 33 + 33 + 20)
    for x, y in zip(shared, plain):
        torch.testing.assert_close(x, y, atol=tol, rtol=tol)


def _update_grads(model, rows, min_shared, reference=None, ref=None, micro_tokens=40):
    model.zero_grad(set_to_none=True)
    scorer = TokenLogProbs(model, chunk_tokens=4)
    old, _ = row_logprobs(scorer, rows, 0, 1000)
    old = [o - 0.05 * (i % 3) for i, o in enumerate(old)]  # ratios != 1 so clipping matters
    adv = torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5, -0.5, 2.0, -2.0])
    s = LossSettings(kl_coef=0.05, entropy_coef=0.01, clip_low=0.02, clip_high=0.03)
    m = mini_batch_backward(scorer, rows, adv, old, ref, s, 0, micro_tokens, min_shared_tokens=min_shared,
                            reference=reference)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, m


@pytest.mark.parametrize("lora", [False, True])
def test_shared_prefix_update_has_the_unshared_gradient(tiny, lora):
    _, tok = tiny
    torch.manual_seed(0)
    model = make_tiny_model(tok, seed=3).to(torch.float64)
    rows = _group_rows()
    reference = ref = None
    if lora:
        from memagent.train.lora import LoraSettings, adapter_disabled, apply_lora

        model = apply_lora(model, LoraSettings(enabled=True, rank=4))
        with torch.no_grad():  # move the adapter off B = 0 so the policy and reference differ
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
        reference = lambda: adapter_disabled(model)  # noqa: E731
    else:
        ref = [o + 0.1 for o in row_logprobs(TokenLogProbs(model, 4), rows, 0, 1000)[0]]
    plain, mp = _update_grads(model, rows, None, reference, ref)
    # micro budget 40: group 1 (12 + 3 x 7 = 33) and group 2 (9 + 3 x 8 = 33) each alone, then the 2 lone rows
    shared, ms = _update_grads(model, rows, 4, reference, ref)
    # LoRA: 2 layers x 7 adapters x (A, B); full: every weight (the head is tied to the embedding)
    assert plain.keys() == shared.keys() and len(plain) == (28 if lora else 20)
    for n in plain:
        torch.testing.assert_close(shared[n], plain[n], atol=1e-8, rtol=1e-5)  # logps pass through float32
        assert float(plain[n].abs().max()) > 0, n
    for k in ("loss", "pg/loss", "kl/mean", "entropy/mean", "pg/clip_frac", "tokens"):
        assert ms[k] == pytest.approx(mp[k], abs=1e-6), k
    assert mp["kl/mean"] > 1e-4  # the KL term is live


def test_fused_reference_equals_a_separate_reference_pass(tiny):
    from memagent.train.lora import LoraSettings, adapter_disabled, apply_lora, reference_logprobs

    _, tok = tiny
    torch.manual_seed(0)
    model = apply_lora(make_tiny_model(tok, seed=4).to(torch.float64), LoraSettings(enabled=True, rank=4))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    rows = _group_rows()
    separate = reference_logprobs(TokenLogProbs(model, 4), rows, 0, 1000)
    g_sep, m_sep = _update_grads(model, rows, 4, None, separate)
    g_fused, m_fused = _update_grads(model, rows, 4, lambda: adapter_disabled(model), None)
    for n in g_sep:
        torch.testing.assert_close(g_fused[n], g_sep[n], atol=1e-12, rtol=1e-10)
    assert m_fused["kl/mean"] == pytest.approx(m_sep["kl/mean"], abs=1e-12) and m_sep["kl/mean"] > 1e-4


def test_sharing_is_refused_where_it_would_be_wrong(tiny):
    _, tok = tiny
    model = make_tiny_model(tok, seed=5)
    model.gradient_checkpointing_enable()
    model.train()
    rows = _group_rows()
    with pytest.raises(ConfigError, match="gradient checkpointing"):
        mini_batch_backward(TokenLogProbs(model, 4), rows, torch.ones(8), None, None, LossSettings(kl_coef=0), 0, 1000,
                            min_shared_tokens=4)
    with pytest.raises(ConfigError, match="not supported under FSDP"):
        row_logprobs(TokenLogProbs(model, 4), rows, 0, 1000, equal_forwards=lambda k: k, min_shared_tokens=4)
    b = pad_rows(rows[:2], 0)
    with torch.no_grad(), pytest.raises(ConfigError, match="do not share their first 13 tokens"):
        shared_prefix_hidden(model.model, b.input_ids, b.attention_mask, [PrefixGroup((0, 1), 13)])


def test_real_templates_group_the_rollouts_that_read_the_same_chunk(tiny):
    from memagent.backends.hf import ChatTokens
    from memagent.train.synthetic import needle_samples
    from memagent.train.synthrows import chunk_first_templates, synthetic_rows

    _, tok = tiny
    chat = ChatTokens(tok, "tiny")
    samples = needle_samples(2, 240, seed=0, prefix="p")
    # chunks long against the instruction, so sharing one chunk's G rows saves more than sharing the instruction
    rows = synthetic_rows(chat, samples, group_size=3, chunk_tokens=128, memory_tokens=10,
                          templates=chunk_first_templates())
    turns = len(rows) // 6
    assert turns >= 3 and len(rows) == 6 * turns
    groups = find_prefix_groups([r.prompt_ids for r in rows], 16)
    # chunk first: the 3 rollouts of a question at chunk k form a group whose prefix runs to the memory
    shared = [g for g in groups if g.prefix_tokens]
    assert len(shared) == 2 * turns and all(len(g.rows) == 3 for g in shared)
    for g in shared:
        assert {rows[i].group_id for i in g.rows} == {rows[g.rows[0]].group_id}
        assert len({i % turns for i in g.rows}) == 1  # the same step of each trajectory
    update_groups = [g for g in shared if not rows[g.rows[0]].is_final]
    memory_tag = chat.tokenizer.encode("<memory>")
    for g in update_groups:  # the shared text ends inside the memory block (memories differ)
        head = list(rows[g.rows[0]].prompt_ids[: g.prefix_tokens])
        assert any(head[k : k + len(memory_tag)] == memory_tag for k in range(len(head)))
    # the default template (memory before section): rows of a question share at least the instruction and question
    samples = needle_samples(2, 80, seed=0, prefix="p")
    rows = synthetic_rows(chat, samples, group_size=3, chunk_tokens=48, memory_tokens=10)
    turns = len(rows) // 6
    groups = find_prefix_groups([r.prompt_ids for r in rows], 16)
    first = [3 * turns * q for q in range(2)]  # the first row of each question's first trajectory
    head = [common_prefix_tokens(rows[i + 1].prompt_ids, rows[i + 2].prompt_ids) for i in first]  # two later updates
    assert min(head) > 16 and all(g.prefix_tokens for g in groups)  # nothing runs unshared
    for g in groups:
        q = rows[g.rows[0]].group_id
        assert {rows[i].group_id for i in g.rows} == {q} and len(g.rows) >= 3
        if not rows[g.rows[0]].is_final:
            assert g.prefix_tokens >= head[q]
