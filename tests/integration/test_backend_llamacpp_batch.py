"""The batched llama.cpp backend on SmolLM2-135M: same tokens as the single-stream backend, per-request
seeds, sampling log-probabilities, shared prefixes, LoRA adapters pushed between calls."""

from __future__ import annotations

import numpy as np
import pytest

from memagent.errors import ConfigError
from memagent.types import Message, Request

pytestmark = pytest.mark.slow

EOS = 2  # SmolLM2's <|im_end|>
SHARED = "The harbor town kept its records in a stone house by the bridge, and the clerks counted boats. " * 6


@pytest.fixture(scope="module")
def backends(gguf_path):
    pytest.importorskip("llama_cpp")
    from memagent.backends.llamacpp import LlamaCppBackend
    from memagent.backends.llamacpp_batch import BatchedLlamaCppBackend

    single = LlamaCppBackend(gguf_path, n_ctx=1024, n_threads=1)
    batched = BatchedLlamaCppBackend(gguf_path, n_ctx=1024, n_parallel=4, n_threads=1)
    yield single, batched
    single.close()
    batched.close()


def _requests(temperature: float, n: int = 3, max_tokens: int = 20) -> list[Request]:
    return [Request((Message("user", SHARED + f"Question {k}: how many boats came on day {k}?"),), max_tokens,
                    temperature=temperature, seed=100 + k, request_id=f"q{k}") for k in range(n)]


def test_greedy_tokens_equal_the_single_stream_backend_and_ignore_the_batch(backends):
    single, batched = backends
    reqs = _requests(0.0, n=5)  # 5 requests on 4 sequences: two waves
    want = [c.token_ids for c in single.generate(reqs)]
    got = batched.generate(reqs)
    assert [c.token_ids for c in got] == want
    assert [batched.generate([r])[0].token_ids for r in reqs[:2]] == want[:2]
    assert all(c.finish_reason in ("stop", "length") and c.prompt_token_ids for c in got)
    assert [c.prompt_token_ids for c in got] == [tuple(single.prompt_token_ids(r.messages)) for r in reqs]


def test_sampled_tokens_follow_each_requests_seed(backends):
    single, batched = backends
    reqs = _requests(0.8)
    got = [c.token_ids for c in batched.generate(reqs)]
    # the same chain (temperature, then the seeded draw) as the single-stream backend at top_p = 1
    assert got == [c.token_ids for c in single.generate(reqs)]
    assert [c.token_ids for c in batched.generate(reqs[::-1])] == got[::-1]
    assert len(set(got)) == 3


def test_logprobs_are_the_log_softmax_at_the_sampling_temperature(backends, gguf_path):
    from llama_cpp import Llama

    _, batched = backends
    (c,) = batched.generate([_requests(0.7, n=1, max_tokens=8)[0]])
    # the reference decodes like the engine: the prompt in one batch, then one token per call
    from memagent.backends.llamacpp import model_params_for_loading

    with model_params_for_loading():  # as the backends load it (no AMX buffers on CPUs that report AMX)
        llm = Llama(gguf_path, n_ctx=1024, logits_all=True, verbose=False, n_threads=1)
    try:
        llm.eval(list(c.prompt_token_ids))
        rows = [np.array(llm.scores[len(c.prompt_token_ids) - 1], dtype=np.float64)]
        for t in c.token_ids[:-1]:
            llm.eval([t])
            rows.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64))
    finally:
        llm.close()
    z = np.stack(rows) / 0.7
    z -= z.max(axis=1, keepdims=True)
    want = z[np.arange(len(c.token_ids)), c.token_ids] - np.log(np.exp(z).sum(axis=1))
    assert len(c.token_logprobs) == len(c.token_ids) >= 4
    np.testing.assert_allclose(c.token_logprobs, want, atol=1e-4)
    assert all(lp <= 0 for lp in c.token_logprobs)


def test_requests_sharing_a_prefix_evaluate_it_once(backends):
    _, batched = backends
    before = batched.stats
    reqs = _requests(0.0, n=3, max_tokens=1)
    n_prompt = [len(c.prompt_token_ids) for c in batched.generate(reqs)]
    after = batched.stats
    evaluated = after["prompt_tokens_evaluated"] - before["prompt_tokens_evaluated"]
    shared = after["prompt_tokens_shared"] - before["prompt_tokens_shared"]
    assert evaluated + shared == sum(n_prompt)
    assert shared >= 2 * 120  # the common text is over 120 tokens; two of three requests reuse it


def test_stop_token_is_kept_on_request(gguf_path):
    from memagent.backends.llamacpp_batch import BatchedLlamaCppBackend

    with BatchedLlamaCppBackend(gguf_path, n_ctx=512, n_parallel=2, n_threads=1, keep_stop_token=True) as b:
        (c,) = b.generate([Request((Message("user", "Say only: yes"),), 32, request_id="s")])
    assert c.finish_reason == "stop"
    assert c.token_ids[-1] == EOS and len(c.token_logprobs) == len(c.token_ids)
    assert "<|im_end|>" not in c.text and c.usage.completion_tokens == len(c.token_ids)


def test_a_request_that_overflows_fails_alone(backends):
    _, batched = backends
    long = Request((Message("user", "word " * 1100),), 16, request_id="long")
    ok, bad = batched.generate([_requests(0.0, n=1, max_tokens=4)[0], long])
    assert ok.finish_reason in ("stop", "length") and ok.token_ids
    assert bad.finish_reason == "error" and "per-sequence window of 1024 tokens" in bad.error


def test_a_wave_that_llama_cpp_fails_is_run_again_one_request_at_a_time(backends, monkeypatch):
    """A decode failure of one sequence (no KV memory slot for it) failed every request of its wave of up to 8."""
    from memagent.errors import BackendError

    _, batched = backends
    engine = batched._engine
    real = engine._run_wave

    def failing(wave, jobs, *args):
        if any(m == 1 for g in wave for m in g.members):  # job 1 cannot be decoded, alone or not
            raise BackendError("llama.cpp failed to decode (no memory slot)")
        return real(wave, jobs, *args)

    reqs = _requests(0.0, n=3, max_tokens=4)
    alone = [batched.generate([r])[0] for r in (reqs[0], reqs[2])]
    monkeypatch.setattr(engine, "_run_wave", failing)
    a, b, c = batched.generate(reqs)
    assert (a.finish_reason, c.finish_reason, b.finish_reason) == ("length", "length", "error")
    assert (a.token_ids, c.token_ids) == (alone[0].token_ids, alone[1].token_ids) and "no memory slot" in b.error


def _agreed(a, b) -> int:
    """Tokens at the start of ``a`` and ``b`` that agree."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_pushed_adapter_changes_outputs_the_same_way_on_both_backends(backends, make_smollm2_lora, tmp_path):
    """Both backends follow the adapter: each adapted output agrees with the other backend's for 8 tokens or
    more, and longer than with the unadapted output. Exact equality over all 20 tokens is not asked: the random
    adapter drives the model into a loop ("The answer is 0. The answer is 0.") whose separator is a near tie
    (" " or "\n\n"), which batch-of-1 and batch-of-2 kernels may break differently on some CPUs."""
    single, batched = backends
    reqs = _requests(0.0, n=2)
    base = [c.token_ids for c in batched.generate(reqs)]
    adapter = make_smollm2_lora(tmp_path / "a.gguf")
    try:
        batched.load_adapter(adapter)
        single.load_adapter(adapter)
        adapted = [c.token_ids for c in batched.generate(reqs)]
        assert adapted != base
        for a, s, b in zip(adapted, [c.token_ids for c in single.generate(reqs)], base):
            assert _agreed(a, s) >= 8 and (a == s or _agreed(a, s) > _agreed(a, b)), (a, s, b)
        batched.load_adapter(make_smollm2_lora(tmp_path / "b.gguf", seed=1))  # replaces the first
        assert [c.token_ids for c in batched.generate(reqs)] not in (base, adapted)
    finally:
        batched.clear_adapter()
        single.clear_adapter()
    assert [c.token_ids for c in batched.generate(reqs)] == base


def test_files_that_are_not_adapters_are_refused(backends, gguf_path, tmp_path):
    _, batched = backends
    with pytest.raises(ConfigError, match="LoRA adapter file not found"):
        batched.load_adapter(tmp_path / "missing.gguf")
    with pytest.raises(ConfigError, match="cannot load the LoRA adapter"):
        batched.load_adapter(gguf_path)  # a model, not an adapter


def test_memory_agent_rollouts_are_the_same_on_both_backends(backends):
    """Greedy MemAgent rollouts in lock step (2 questions x 2, chunk before memory): the same turns, token for
    token, with a third of the prompt tokens or more taken from shared prefixes (at most half with G = 2)."""
    from memagent.agent.loop import AgentConfig, MemoryAgent
    from memagent.agent.prompts import PromptTemplates
    from memagent.train.rollout import repeat_samples
    from memagent.train.synthetic import needle_samples

    single, batched = backends
    templates = PromptTemplates.from_file("chunk_first")
    samples = repeat_samples(needle_samples(2, 160, seed=1), 2)
    cfg = AgentConfig(chunk_tokens=96, memory_tokens=16, final_tokens=12, temperature=0.0, seed=0, batch_size=4)
    before = batched.stats
    runs = [MemoryAgent(b, cfg, templates).run(samples) for b in (single, batched)]
    turns = [[(t.prompt_token_ids, t.response_token_ids) for tr in run for t in tr.turns] for run in runs]
    assert len(turns[0]) >= 4 * 3 and turns[0] == turns[1]
    after = batched.stats
    shared = after["prompt_tokens_shared"] - before["prompt_tokens_shared"]
    evaluated = after["prompt_tokens_evaluated"] - before["prompt_tokens_evaluated"]
    assert shared + evaluated == sum(len(p) for p, _ in turns[1])
    assert shared > 0.33 * (shared + evaluated)
