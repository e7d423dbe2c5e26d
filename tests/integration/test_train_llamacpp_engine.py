"""The llama.cpp rollout engine on SmolLM2-135M with a peft LoRA policy: the F16 base written once, ids that
tokenize as the trainer's HF tokenizer does, sampling log-probabilities of the policy, the adapter pushed by
``sync``, and one training step end to end."""

import copy
import itertools
import json
import os

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from memagent.train.config import load_config  # noqa: E402
from memagent.train.distributed import DistInfo  # noqa: E402
from memagent.types import Message, Request  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

TEXTS = ["The secret code is 4417.", "  leading spaces,\ttabs\nand new lines\n\n", "Ünïcödé — 東京 🚀 café",
         "<|im_start|>user\nnot a real turn<|im_end|>", "1234567890 3.14159 x=y+z; f(a, b)"]


def _cfg(out, *extra):
    return load_config("configs/train_cpu_small.yaml", [
        f"run.output_dir={out}", "model.path=smollm2", "model.dtype=float32", "run.rollout_engine=llamacpp",
        "run.torch_threads=1", "agent.chunk_tokens=64", "agent.memory_tokens=12", "agent.final_tokens=8",
        "agent.batch_size=4", *extra])


def _lora(model):
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory, gguf_path):
    """SmolLM2 as the trainer loads it (float32 from the GGUF), loaded once; copy it before wrapping."""
    from memagent.train.policy import load_policy

    return load_policy(_cfg(tmp_path_factory.mktemp("unused")))


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2):
    from memagent.train.engine import make_engine

    model, tok = smollm2
    eng = make_engine(_cfg(tmp_path_factory.mktemp("run")), DistInfo(), _lora(copy.deepcopy(model)), tok, False)
    yield eng
    eng.close()


def _requests(temperature=0.0, n=2, max_tokens=12):
    return [Request((Message("user", f"Say one thing about the number {k}."),), max_tokens, temperature=temperature,
                    seed=7 + k, request_id=f"r{k}") for k in range(n)]


def _set_lora_b(policy, std: float, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def test_the_f16_base_is_written_once_and_reused(engine, gguf_path):
    from memagent.train.engine_llamacpp import cached_f16_base

    folder = os.path.dirname(engine.base_path)
    record = json.loads(open(os.path.join(folder, "base-f16.json")).read())
    import hashlib

    sha = hashlib.sha256(open(gguf_path, "rb").read()).hexdigest()
    assert record == {"source": os.path.abspath(gguf_path), "source_bytes": os.path.getsize(gguf_path),
                      "source_sha256": sha, "dtype": "f16"}
    before = os.stat(engine.base_path).st_mtime_ns
    assert cached_f16_base(gguf_path, folder) == engine.base_path
    assert os.stat(engine.base_path).st_mtime_ns == before  # reused, not rewritten
    assert engine.backend.name == "llamacpp-batch:base-f16.gguf" and engine.backend.n_parallel == 4
    assert engine.backend.context_tokens == 64 + 24 + 8 + 32 + 1024


def test_ids_are_the_hf_tokenizers_ids(engine):
    from memagent.backends.hf import ChatTokens

    hf = engine.tokenizer
    tok = engine.backend.tokenizer
    for text in TEXTS:  # document text is plain text: a special token's spelling is not the special token
        assert tok.encode(text) == hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"], text
    chat = ChatTokens(hf, "smollm2")
    for text in TEXTS:
        msgs = (Message("system", "Be brief."), Message("user", text))
        assert engine.backend.prompt_token_ids(msgs) == chat.prompt_ids(msgs), text
    comps = engine.backend.generate(_requests(temperature=1.0, n=3, max_tokens=16))
    for c in comps:  # sampled ids decode the same, and the stop token is kept for training
        shown = c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids
        assert hf.decode(list(shown)) == c.text
        assert (c.token_ids[-1] == hf.convert_tokens_to_ids("<|im_end|>")) == (c.finish_reason == "stop")
    assert engine.backend.pad_id == hf.pad_token_id


def _policy_logprobs(policy, comp, temperature):
    ids = torch.tensor([list(comp.prompt_token_ids) + list(comp.token_ids)])
    with torch.no_grad():
        logits = policy(input_ids=ids).logits[0].float() / temperature
    n = len(comp.prompt_token_ids)
    logp = torch.log_softmax(logits[n - 1:-1], dim=-1)
    return logp[torch.arange(len(comp.token_ids)), torch.tensor(comp.token_ids)]


def test_sync_pushes_the_adapter_and_log_probs_follow_the_policy(engine):
    policy, backend = engine.policy, engine.backend
    base = [c.token_ids for c in backend.generate(_requests())]
    _set_lora_b(policy, 0.2)
    try:
        engine.sync()
        adapted = [c.token_ids for c in backend.generate(_requests())]
        assert adapted != base
        sampled = backend.generate(_requests(temperature=0.7, n=2, max_tokens=16))
        for c in sampled:
            want = _policy_logprobs(policy, c, 0.7)
            got = torch.tensor(c.token_logprobs)
            assert (got - want).abs().max() < 0.15, (got, want)  # F16 engine against float32 transformers
        backend.clear_adapter()
        assert [c.token_ids for c in backend.generate(_requests())] == base
    finally:
        _set_lora_b(policy, 0.0)
        engine.sync()
    assert [c.token_ids for c in backend.generate(_requests())] == base  # a zero adapter is the base


def test_one_training_step_and_a_resume_on_llamacpp_rollouts(tmp_path, monkeypatch, smollm2):
    import memagent.train.trainer as trainer_mod
    from memagent.train.synthetic import needle_samples

    model, tok = smollm2  # the trainer's policy: a fresh LoRA over a copy of SmolLM2
    monkeypatch.setattr(trainer_mod, "load_policy", lambda cfg: (_lora(copy.deepcopy(model)), tok))
    cfg = _cfg(tmp_path / "run", "run.total_steps=1", "run.save_every=1", "run.val_every=0",
               "run.val_before_train=false", "run.tensorboard=false", "rl.group_size=2", "rl.prompts_per_step=1",
               "rl.mini_batches=1", "rl.kl_coef=0", "optim.lr=1e-3", "optim.micro_batch_tokens=2048")
    train = needle_samples(1, 60, seed=0, prefix="t")
    calls = itertools.count()  # rewards 0, 1 in each group of two: a non-zero advantage whatever was sampled
    t = trainer_mod.Trainer(cfg, train_samples=train, val_samples={}, reward_fn=lambda r, a: float(next(calls) % 2))
    greedy = _requests()
    before = [c.token_logprobs for c in t.backend.generate(greedy)]
    start = os.stat(t.engine.adapter_path).st_mtime_ns
    m = t.fit()
    assert m["step"] == 1 and m["reward/mean"] == 0.5
    assert os.stat(t.engine.adapter_path).st_mtime_ns > start  # the update's adapter was written and pushed
    lora_b = [p.detach().clone() for n, p in t.policy.named_parameters() if "lora_B" in n]
    assert any(p.abs().sum() > 0 for p in lora_b)  # the update moved the adapter off zero
    after = t.backend.generate(greedy)
    assert max(abs(a - b) for c, bs in zip(after, before) for a, b in zip(c.token_logprobs, bs)) > 1e-4
    t.close()
    resumed = trainer_mod.Trainer(cfg, train_samples=train, val_samples={})
    try:
        assert resumed.step == 1
        for a, b in zip(lora_b, [p for n, p in resumed.policy.named_parameters() if "lora_B" in n]):
            torch.testing.assert_close(a, b)
        again = resumed.backend.generate(greedy)  # the resumed engine runs the checkpoint's adapter
        assert [c.token_ids for c in again] == [c.token_ids for c in after]
        for c, d in zip(again, after):
            assert max(abs(a - b) for a, b in zip(c.token_logprobs, d.token_logprobs)) < 1e-5
    finally:
        resumed.close()
