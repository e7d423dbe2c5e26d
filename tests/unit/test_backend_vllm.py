"""VLLMBackend's own logic against an engine double (vllm itself is not installed in CI).

The double records what the backend hands the engine (token-id prompts, sampling parameters, weights) and
returns scripted outputs shaped like ``vllm.RequestOutput``. A real engine is exercised in
tests/integration/test_backend_vllm_engine.py where the vllm package is installed.
"""

import sys
import types
import zlib
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from memagent.backends import make_backend  # noqa: E402
from memagent.backends.hf import ChatTokens  # noqa: E402
from memagent.backends.vllm import VLLMBackend  # noqa: E402
from memagent.errors import ConfigError  # noqa: E402
from memagent.types import Message, Request  # noqa: E402


class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = types.ModuleType("vllm")
    mod.SamplingParams = SamplingParams
    monkeypatch.setitem(sys.modules, "vllm", mod)
    return mod


class FakeModel:
    def __init__(self):
        self.loaded = []

    def load_weights(self, weights):
        self.loaded.append(list(weights))
        return {name for name, _ in weights}


class FakeLLM:
    """Returns ``script[k]`` = (token_ids, finish_reason, stop_reason) for the k-th prompt of each call."""

    def __init__(self, script=None, fail=None, reload=True):
        self.script, self.fail, self.reload = script or [], fail, reload
        self.calls, self.model, self.resets, self.reloads = [], FakeModel(), 0, []

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append((prompts, params))
        if self.fail:
            raise self.fail
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, finish_reason=fin, stop_reason=why)])
                for ids, fin, why in self.script[: len(prompts)]]

    def apply_model(self, fn):
        return [fn(self.model)]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if method != "reload_weights" or not self.reload:
            raise NotImplementedError(f"Method {method!r} is not implemented.")
        self.reloads.append(kwargs)

    def reset_prefix_cache(self):
        self.resets += 1


@pytest.fixture
def model_dir(tmp_path):
    """A model directory without generation_config.json: stop tokens come from the tokenizer alone."""
    (tmp_path / "tiny-model").mkdir()
    return str(tmp_path / "tiny-model")


def backend_with(tok, llm, model_dir, **kw):
    return VLLMBackend(model_dir, tokenizer=tok, llm=llm, context_tokens=kw.pop("context_tokens", 512), **kw)


def req(text, rid, max_tokens=8, temperature=0.0, top_p=1.0, seed=None):
    return Request((Message("user", text),), max_tokens, temperature, top_p, seed, rid)


def test_engine_gets_the_chat_token_ids_and_request_sampling(fake_vllm, tiny, model_dir):
    _, tok = tiny
    llm = FakeLLM([([5, 6], "length", None), ([7], "length", None)])
    b = backend_with(tok, llm, model_dir, seed=3)
    greedy, sampled = req("the fox", "s/0"), req("a dog", "s/1", max_tokens=4, temperature=0.7, top_p=0.9, seed=11)
    b.generate([greedy, sampled])
    (prompts, params), = llm.calls
    want = ChatTokens(tok, "x").prompt_ids(greedy.messages)
    assert prompts[0] == {"prompt_token_ids": want}
    g, s = params
    assert (g.temperature, g.top_p, g.top_k, g.max_tokens, g.n) == (0.0, 1.0, 0, 8, 1)
    assert (s.temperature, s.top_p, s.max_tokens) == (0.7, 0.9, 4)
    assert g.stop_token_ids == b.stop_ids and tok.convert_tokens_to_ids("<|im_end|>") in b.stop_ids
    # per-request seeds: crc32 of "<base>|<request seed>:<request id>", 31 bits
    assert g.seed == zlib.crc32(b"3|None:s/0") & 0x7FFFFFFF
    assert s.seed == zlib.crc32(b"3|11:s/1") & 0x7FFFFFFF
    assert b.name == "vllm:tiny-model" and b.context_tokens == 512


def test_prompt_matches_the_chat_template(fake_vllm, tiny, model_dir):
    _, tok = tiny
    llm = FakeLLM([([5], "length", None)])
    b = backend_with(tok, llm, model_dir)
    msgs = (Message("system", "be brief"), Message("user", "the quick brown fox"))
    want = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in msgs], tokenize=True,
                                   add_generation_prompt=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    b.generate([Request(msgs, 4, request_id="r")])
    assert llm.calls[0][0][0]["prompt_token_ids"] == list(want)


def test_completion_keeps_the_stop_token_and_decodes_without_it(fake_vllm, tiny, model_dir):
    _, tok = tiny
    end = tok.convert_tokens_to_ids("<|im_end|>")
    hello = tok.encode("hello world", add_special_tokens=False)
    llm = FakeLLM([(hello + [end], "stop", end), (hello, "length", None)])
    b = backend_with(tok, llm, model_dir)
    with_stop, cut = b.generate([req("a", "a", 32), req("c", "c", max_tokens=len(hello))])
    assert with_stop.token_ids == tuple(hello + [end]) and with_stop.finish_reason == "stop"
    assert with_stop.text == "hello world"
    assert cut.token_ids == tuple(hello) and cut.finish_reason == "length" and cut.text == "hello world"
    assert with_stop.usage.completion_tokens == len(hello) + 1
    assert with_stop.usage.prompt_tokens == len(with_stop.prompt_token_ids) > 0


def test_too_long_prompt_is_an_error_row_and_others_still_run(fake_vllm, tiny, model_dir):
    _, tok = tiny
    llm = FakeLLM([([5], "length", None)])
    b = backend_with(tok, llm, model_dir, context_tokens=40)
    long, short = req("word " * 60, "long", max_tokens=4), req("hi", "short", max_tokens=4)
    out = b.generate([long, short])
    assert out[0].finish_reason == "error" and out[0].error.startswith("[request long] prompt ")
    assert "context window of 40 tokens" in out[0].error
    assert out[1].token_ids == (5,)
    assert len(llm.calls[0][0]) == 1  # the engine never saw the long prompt


def test_engine_failure_becomes_error_completions(fake_vllm, tiny, model_dir):
    _, tok = tiny
    b = backend_with(tok, FakeLLM(fail=RuntimeError("CUDA out of memory")), model_dir)
    out = b.generate([req("a", "x/0"), req("b", "x/1")])
    assert [c.finish_reason for c in out] == ["error", "error"]
    assert out[1].error == "[request x/1] RuntimeError: CUDA out of memory"


def test_load_weights_reloads_in_place_and_clears_the_prefix_cache(fake_vllm, tiny, model_dir):
    _, tok = tiny
    llm = FakeLLM()
    b = backend_with(tok, llm, model_dir)
    b.load_weights(iter([("model.embed_tokens.weight", 1), ("lm_head.weight", 2)]))
    assert llm.reloads == [{"weights_iterator": [("model.embed_tokens.weight", 1), ("lm_head.weight", 2)],
                            "is_checkpoint_format": True}]
    assert llm.model.loaded == [] and llm.resets == 1
    old = FakeLLM(reload=False)  # a vLLM without reload_weights: the model's own load_weights
    backend_with(tok, old, model_dir).load_weights([("model.norm.weight", 3)])
    assert old.model.loaded == [[("model.norm.weight", 3)]] and old.resets == 1


def test_weights_are_cast_to_the_engine_dtype(fake_vllm, tiny, model_dir):
    torch = pytest.importorskip("torch")
    _, tok = tiny
    llm = FakeLLM()
    llm.llm_engine = SimpleNamespace(model_executor=object(), model_config=SimpleNamespace(dtype=torch.bfloat16,
                                                                                           max_model_len=512))
    backend_with(tok, llm, model_dir).load_weights([("w", torch.ones(2, dtype=torch.float32, requires_grad=True))])
    (pushed,) = llm.reloads[0]["weights_iterator"]
    assert pushed[1].dtype == torch.bfloat16 and not pushed[1].requires_grad


def test_pushing_into_an_engine_in_another_process_is_refused(fake_vllm, tiny, model_dir):
    _, tok = tiny
    llm = FakeLLM()
    llm.llm_engine = SimpleNamespace()  # vLLM's multiprocess client: no model_executor
    with pytest.raises(ConfigError, match="weight_sync=True"):
        backend_with(tok, llm, model_dir).load_weights([("w", 1)])


def test_missing_vllm_is_a_clear_error(monkeypatch, tiny, tmp_path):
    _, tok = tiny
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(ConfigError, match="pip install vllm"):
        make_backend("vllm", model=str(tmp_path), tokenizer=tok)


def test_bad_settings_are_refused(tiny, model_dir):
    _, tok = tiny
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        VLLMBackend(model_dir, tokenizer=tok, llm=FakeLLM(), gpu_memory_utilization=0)
    with pytest.raises(ConfigError, match="context window"):
        VLLMBackend(model_dir, tokenizer=tok, llm=FakeLLM(), context_tokens=0)


def test_close_shuts_the_engine_down_once(fake_vllm, tiny, model_dir):
    _, tok = tiny
    llm = FakeLLM()
    calls = []
    llm.llm_engine = SimpleNamespace(model_executor=object(), engine_core=SimpleNamespace(shutdown=lambda: calls.append(1)))
    b = backend_with(tok, llm, model_dir)
    b.close()
    b.close()
    assert calls == [1] and b.llm is None


def test_a_model_path_that_does_not_exist_is_named_before_anything_loads(monkeypatch, tmp_path):
    """`--backend vllm --model /nonexistent` gave a transformers traceback (issue 17, item 9)."""
    import transformers

    monkeypatch.setitem(sys.modules, "vllm", None)  # importing vllm would fail differently
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    for missing in ("/nonexistent", str(tmp_path / "no" / "such"), "./not-here", "~/memagent-none"):
        with pytest.raises(ConfigError, match=f"vllm backend: model '{missing}' does not exist; give an HF model"):
            VLLMBackend(missing)
    from memagent.backends.vllm import check_model_path

    assert check_model_path("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"  # a hub name: the hub's
    assert check_model_path(str(tmp_path)) == str(tmp_path)


def test_a_tokenizer_that_cannot_load_is_a_config_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ConfigError, match=r"vllm backend: cannot load the tokenizer of model '.*'"):
        VLLMBackend(str(tmp_path))  # a folder without tokenizer files
