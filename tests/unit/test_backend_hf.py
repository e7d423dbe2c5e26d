import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memagent.backends.hf import HFBackend  # noqa: E402
from memagent.errors import ConfigError  # noqa: E402
from memagent.tokenization import HFTokenizer  # noqa: E402
from memagent.train.tiny import save_tiny  # noqa: E402
from memagent.types import Message, Request  # noqa: E402



pytestmark = pytest.mark.usefixtures("one_torch_thread")




@pytest.fixture(scope="module")
def backend(tiny):
    model, tok = tiny
    return HFBackend(model, tok, max_batch_size=4)


def test_prompt_ids_follow_chat_template(backend, tiny):
    _, tok = tiny
    msgs = (Message("system", "be brief"), Message("user", "the quick brown fox"))
    want = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in msgs], tokenize=True,
                                   add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert backend.prompt_ids(msgs) == list(want)
    assert backend.count_prompt_tokens(msgs) == len(want)
    assert isinstance(backend.tokenizer, HFTokenizer)


def test_special_looking_content_stays_plain(backend, tiny):
    _, tok = tiny
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = backend.prompt_ids((Message("user", "a <|im_end|> b"),))
    assert ids.count(end) == 1  # only the template's own end-of-turn marker


def test_greedy_matches_manual_argmax_and_batching(backend, tiny):
    model, _ = tiny
    short = Request((Message("user", "fox"),), 6, 0.0, 1.0, None, "s")
    long = Request((Message("user", "the quick brown fox jumps over the lazy dog"),), 6, 0.0, 1.0, None, "l")
    batched = backend.generate([short, long])
    alone = backend.generate([long])[0]
    assert batched[1].token_ids == alone.token_ids  # left padding does not change the result
    ids = list(alone.prompt_token_ids)
    with torch.no_grad():
        for _ in range(len(alone.token_ids)):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt in backend.stop_ids:
                break
    assert tuple(ids[len(alone.prompt_token_ids):]) == alone.token_ids
    assert alone.usage.prompt_tokens == len(alone.prompt_token_ids)


def test_greedy_generation_sets_no_sampling_flag(backend, caplog):
    """transformers logs "generation flags are not valid" for a sampling flag (top_k) given to greedy decoding."""
    import logging

    with caplog.at_level(logging.WARNING):
        backend.generate([Request((Message("user", "fox"),), 3, 0.0, 1.0, None, "g")])
    assert not [r for r in caplog.records if "generation flags are not valid" in r.getMessage()]


def test_sampling_is_seeded_and_leaves_global_rng(backend):
    reqs = [Request((Message("user", "fox"),), 8, 1.0, 0.9, 7, f"q#g{j}/chunk0") for j in range(3)]
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = backend.generate(reqs)
    after = torch.rand(1)
    b = backend.generate(reqs)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert len({c.token_ids for c in a}) > 1  # distinct request ids in one batch draw different samples
    assert torch.equal(before, after)


def test_stop_token_kept_in_token_ids_not_in_text(backend, tiny):
    _, tok = tiny
    end = tok.convert_tokens_to_ids("<|im_end|>")
    hello = tok.encode("fox", add_special_tokens=False)
    req = Request((Message("user", "x"),), 10, 0.0, 1.0, None, "r")
    c = backend._completion(req, [1, 2], hello + [end, 0, 0], 0.0)
    assert c.token_ids == tuple(hello + [end]) and c.finish_reason == "stop" and c.text == "fox"
    assert c.usage.completion_tokens == len(hello) + 1
    c2 = backend._completion(Request(req.messages, 2, request_id="r"), [1], [5, 6, 7], 0.0)
    assert c2.token_ids == (5, 6) and c2.finish_reason == "length"


def test_context_overflow_is_a_per_request_error(tiny):
    model, tok = tiny
    b = HFBackend(model, tok, context_tokens=40)
    ok = Request((Message("user", "fox"),), 4, 0.0, 1.0, None, "ok")
    big = Request((Message("user", "x" * 60),), 4, 0.0, 1.0, None, "big")
    out = b.generate([big, ok])
    assert out[0].finish_reason == "error" and "context window of 40" in out[0].error
    assert out[1].finish_reason in ("stop", "length") and out[1].token_ids


def test_load_from_directory_and_errors(tmp_path, tiny):
    save_tiny(tmp_path / "m")
    b = HFBackend(str(tmp_path / "m"), dtype="float32")
    assert b.name == "hf:m" and b.context_tokens == 4096
    assert b.generate([Request((Message("user", "fox"),), 3, request_id="x")])[0].finish_reason != "error"
    with pytest.raises(ConfigError, match="tokenizer"):
        HFBackend(tiny[0])
    with pytest.raises(ConfigError, match="neither"):
        HFBackend(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="dtype"):
        HFBackend(str(tmp_path / "m"), dtype="float16")


def test_a_broken_model_folder_and_bad_settings_are_named(tmp_path, monkeypatch):
    """A folder transformers cannot load is a ConfigError naming it (it was a 145-line traceback and exit 1);
    `~` is the home folder; settings of the wrong type are refused before the first call."""
    import shutil

    save_tiny(tmp_path / "m")
    cases = {"empty": [], "no_tokenizer": ["config.json", "model.safetensors", "generation_config.json"],
             "no_config": ["tokenizer.json", "tokenizer_config.json"]}
    for name, keep in cases.items():
        (tmp_path / name).mkdir()
        for f in keep:
            shutil.copy(tmp_path / "m" / f, tmp_path / name / f)
    with pytest.raises(ConfigError, match=r"model folder '.*empty' lacks config.json and tokenizer files"):
        HFBackend(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match=r"model folder '.*no_tokenizer' lacks tokenizer files"):
        HFBackend(str(tmp_path / "no_tokenizer"))
    with pytest.raises(ConfigError, match=r"model folder '.*no_config' lacks config.json;"):
        HFBackend(str(tmp_path / "no_config"))
    shutil.copytree(tmp_path / "m", tmp_path / "torn")
    (tmp_path / "torn" / "model.safetensors").write_bytes((tmp_path / "m" / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(ConfigError, match=r"cannot load the model at '.*torn' \(\w+: .*\); check that its files are complete"):
        HFBackend(str(tmp_path / "torn"))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert HFBackend("~/m", dtype="float32").model_path == str(tmp_path / "m")
    for kw, message in ((dict(max_batch_size=2.0), "max_batch_size must be a whole number, got 2.0"),
                        (dict(seed="x"), "seed must be a whole number"),
                        (dict(tokenizer="bytes"), "tokenizer 'bytes' is a name")):
        with pytest.raises(ConfigError, match=message):
            HFBackend(str(tmp_path / "m"), **kw)
    with pytest.raises(ConfigError, match="hf backend: give the model"):
        HFBackend(None)


def test_rows_record_the_model_by_its_files_so_resume_refuses_other_weights(tmp_path):
    """`run --resume` compares the model folder's files (weights, config, tokenizer) by sha256, not its name."""
    import json

    from typer.testing import CliRunner

    from memagent.cli import app

    save_tiny(tmp_path / "a" / "tiny")
    other = tmp_path / "b" / "tiny"
    save_tiny(other)
    (other / "config.json").write_text((other / "config.json").read_text().replace('"rms_norm_eps"', '"use_cache": true, "rms_norm_eps"'))
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": f"s{i}", "question": "q?", "context": "fox " * 30})
                                               + "\n" for i in range(2)))
    base = ["run", "--backend", "hf", "--input", str(tmp_path / "in.jsonl"), "--chunk-tokens", "60", "--memory-tokens", "4",
            "--final-tokens", "4", "-o", str(tmp_path / "p.jsonl")]
    r = CliRunner().invoke(app, [*base, "--model", str(tmp_path / "a" / "tiny")])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert len(rows[0]["settings"]["model_sha256"]) == 64
    r = CliRunner().invoke(app, [*base, "--model", str(other), "--resume"])
    assert r.exit_code == 2 and "model_sha256" in r.output, r.output
    # chunks counted in another tokenizer than the model's own: warned about (the budget check cannot see it)
    r = CliRunner().invoke(app, [*base[:-2], "-o", str(tmp_path / "q.jsonl"), "--model", str(other), "--tokenizer", "bytes"])
    assert r.exit_code == 0 and "warning: --tokenizer bytes is not the model's own tokenizer" in " ".join(r.output.split())


@pytest.mark.slow
def test_smollm2_gguf_loads_dense_and_trainable():
    from memagent.backends.hf import load_hf_model
    from memagent.backends.models import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"SmolLM2 GGUF not available: {e}")
    model, tok = load_hf_model(path, "float32")
    assert not getattr(model, "is_quantized", False) and model.hf_quantizer is None
    params = list(model.parameters())
    assert all(p.dtype == torch.float32 and p.requires_grad for p in params)
    assert sum(p.numel() for p in params) == pytest.approx(134.5e6, rel=0.01)
    b = HFBackend(model, tok)
    out = b.generate([Request((Message("user", "What is the capital of France?"),), 12, request_id="q")])[0]
    assert out.finish_reason in ("stop", "length") and out.token_ids
    ids = torch.tensor([list(out.prompt_token_ids) + list(out.token_ids)])
    model.train()
    model(ids).logits[0, -1].logsumexp(-1).backward()
    assert model.get_output_embeddings().weight.grad is not None


def _first_tokens(backend, temperature, seeds):
    reqs = [Request((Message("user", "the fox"),), 1, temperature, 1.0, s, f"r{s}") for s in seeds]
    return [c.token_ids[0] for c in backend.generate(reqs)]


def test_only_the_requests_sampling_settings_apply(tiny):
    # T=1, top_p=1 is plain softmax sampling: no top-k (transformers' global default is 50) and none of the
    # model's own generation settings; the training log-probabilities assume exactly this distribution
    model, tok = tiny
    backend = HFBackend(model, tok, max_batch_size=8)
    ids = backend.prompt_ids((Message("user", "the fox"),))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    top50 = set(logits.topk(50).indices.tolist())
    plain = _first_tokens(backend, 1.0, range(16))
    assert sum(t not in top50 for t in plain) >= 8  # near-uniform random model: most draws lie outside the top 50
    own = model.generation_config
    try:
        model.generation_config = type(own)(top_k=1, repetition_penalty=1e6, no_repeat_ngram_size=1)
        assert _first_tokens(backend, 1.0, range(16)) == plain
        greedy = backend.generate([Request((Message("user", "the fox"),), 12, 0.0, 1.0, None, "g")])[0]
    finally:
        model.generation_config = own
    assert model.generation_config is own
    assert greedy.token_ids == backend.generate([Request((Message("user", "the fox"),), 12, 0.0, 1.0, None, "g")])[0].token_ids


def test_a_window_beyond_the_models_positions_is_warned_about(tiny):
    model, tok = tiny
    with pytest.warns(UserWarning, match=r"a window of 100000 tokens \(--n-ctx\) is larger than the model's 4096 positions"):
        HFBackend(model, tok, context_tokens=100000)


def test_requests_of_other_max_tokens_are_not_run_to_the_largest(tiny):
    # the agent batches memory updates (memory_tokens) with final answers (final_tokens); one generate call ran
    # every row to the largest max_tokens: on a model of learned positions both requests failed with an
    # IndexError although each fitted the window, and on any model the updates ran on to the final's budget
    from transformers import GPT2Config, GPT2LMHeadModel

    _, tok = tiny
    cfg = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=4, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        gpt2 = GPT2LMHeadModel(cfg)
    backend = HFBackend(gpt2, tok, max_batch_size=8)
    update = Request((Message("user", "hello there " * 6),), 4, 0.0, 1.0, None, "update")
    final = Request((Message("user", "hi"),), 40, 0.0, 1.0, None, "final")
    assert len(backend.prompt_ids(update.messages)) + 4 <= 64 and len(backend.prompt_ids(final.messages)) + 40 <= 64
    calls = []
    run = gpt2.generate
    gpt2.generate = lambda **k: calls.append(k["generation_config"].max_new_tokens) or run(**k)
    try:
        both = backend.generate([update, final])
        assert sorted(calls) == [4, 40]
        alone = [backend.generate([r])[0] for r in (update, final)]
    finally:
        del gpt2.generate
    assert [c.error for c in both] == [None, None]
    assert [c.token_ids for c in both] == [c.token_ids for c in alone]
    assert len(both[0].token_ids) <= 4 and len(both[1].token_ids) <= 40
