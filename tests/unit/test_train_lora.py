"""LoRA: settings, adapter injection, the reference as the adapter-disabled policy, adapter-only checkpoints."""

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from memagent.errors import ConfigError  # noqa: E402
from memagent.train.batching import TokenLogProbs, row_logprobs  # noqa: E402
from memagent.train.config import load_config  # noqa: E402
from memagent.train.lora import (  # noqa: E402
    LoraSettings, adaptable_module_names, adapter_state_dict, apply_lora, check_resume_kind, is_lora,
    load_lora_checkpoint_state, lora_checkpoint_state, reference_logprobs,
)
from memagent.train.rollout import Row  # noqa: E402
from memagent.train.tiny import make_tiny_model, make_tiny_tokenizer  # noqa: E402
from memagent.train.update import LossSettings, mini_batch_backward  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def _rows():
    g = torch.Generator().manual_seed(5)
    spec = [(6, 3, 0, False), (5, 4, 0, True), (7, 2, 1, False), (4, 5, 1, True)]
    rows = []
    for p, r, t, f in spec:
        ids = torch.randint(3, 300, (p + r,), generator=g).tolist()
        rows.append(Row(tuple(ids[:p]), tuple(ids[p:]), t, 0, f))
    return rows


def _lora_model(tok, settings=LoraSettings(enabled=True), dtype=torch.float32, seed=0):
    torch.manual_seed(123)
    return apply_lora(make_tiny_model(tok, seed=seed).to(dtype), settings)


def test_tied_embedding_layers_are_refused_as_targets(tok):
    """The tiny model ties embed_tokens and lm_head (as SmolLM2 does): merging an adapter on one changes both, so
    the exported model was not the trained policy (logits 19 apart for embed_tokens)."""
    for target in ("embed_tokens", "lm_head"):
        with pytest.raises(ConfigError, match=rf"model.lora.target_modules \['{target}'\]: this model ties its input "
                                              r"embedding and output head"):
            _lora_model(tok, LoraSettings(enabled=True, target_modules=("q_proj", target)))
    untied = make_tiny_model(tok)
    untied.config.tie_word_embeddings = False
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    assert apply_lora(untied, LoraSettings(enabled=True, target_modules=("lm_head",))) is not None


def test_settings_are_checked():
    for kw, msg in [({"rank": 0}, "rank must be >= 1"), ({"alpha": 0}, "alpha must be > 0"),
                    ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"), ({"target_modules": ()}, "at least one")]:
        with pytest.raises(ConfigError, match=msg):
            LoraSettings(**kw)


def test_config_embeds_lora_and_bf16_base_does_not_warn():
    cfg = load_config(None, ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.target_modules=[q_proj, v_proj]"])
    assert cfg.model.lora == LoraSettings(enabled=True, rank=4, target_modules=("q_proj", "v_proj"))
    assert load_config(None).model.lora.enabled is False  # full fine-tuning is the default
    with pytest.raises(ConfigError, match="did you mean model.lora.rank"):
        load_config(None, ["model.lora.rnak=4"])
    with warnings.catch_warnings():  # the adapters are float32 even on a bfloat16 base
        warnings.simplefilter("error")
        load_config(None, ["model.dtype=bfloat16", "optim.lr=1e-5", "model.lora.enabled=true"])
    with pytest.warns(UserWarning, match="round away"):
        load_config(None, ["model.dtype=bfloat16", "optim.lr=1e-5"])


def test_only_adapters_train_and_missing_targets_list_the_models_modules(tok):
    model = _lora_model(tok)
    assert is_lora(model) and is_lora(TokenLogProbs(model))
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # hidden 32, kv 2 x head 8 = 16, MLP 64; rank 8: r * (in + out) per projection, 2 layers
    per_layer = 8 * ((32 + 32) + (32 + 16) * 2 + (32 + 32) + (32 + 64) * 2 + (64 + 32))
    assert sum(trainable.values()) == 2 * per_layer == 8192
    assert set(adapter_state_dict(model)) == set(trainable)
    with pytest.raises(ConfigError) as e:
        apply_lora(make_tiny_model(tok), LoraSettings(enabled=True, target_modules=("q_proj", "c_attn")))
    assert str(e.value) == ("model.lora.target_modules ['c_attn'] are not modules of this model; it has: "
                            "down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj")
    assert adaptable_module_names(make_tiny_model(tok))[0] == "down_proj"


def test_bfloat16_base_keeps_float32_adapters(tok):
    model = _lora_model(tok, dtype=torch.bfloat16)
    dtypes = {(p.requires_grad, p.dtype) for p in model.parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}
    lp, _ = TokenLogProbs(model)(torch.tensor([[5, 6, 7, 8]]), torch.ones(1, 4, dtype=torch.long))
    assert lp.dtype == torch.float32 and torch.isfinite(lp).all()


def _train_adapter(model, rows, steps, lr=0.05):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    scorer = TokenLogProbs(model, chunk_tokens=4)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        mini_batch_backward(scorer, rows, torch.tensor([1.0, 1.0, -1.0, -1.0]), None, None, LossSettings(kl_coef=0.0), 0, 64)
        opt.step()
    return opt


def test_reference_is_the_adapter_disabled_policy(tok):
    rows = _rows()
    base = make_tiny_model(tok)
    frozen_copy = copy.deepcopy(base).eval().requires_grad_(False)  # the full fine-tuning reference
    want, _ = row_logprobs(TokenLogProbs(frozen_copy, 4), rows, 0, 64)
    torch.manual_seed(123)
    model = apply_lora(base, LoraSettings(enabled=True))
    start, _ = row_logprobs(TokenLogProbs(model, 4), rows, 0, 64)
    for a, b in zip(start, want):  # B = 0 at init: the adapted policy starts at the base model
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _train_adapter(model, rows, steps=2)
    scorer = TokenLogProbs(model, 4)
    now, _ = row_logprobs(scorer, rows, 0, 64)
    ref = reference_logprobs(scorer, rows, 0, 64)
    assert max(float((a - b).abs().max()) for a, b in zip(now, want)) > 1e-3  # the policy moved
    for a, b in zip(ref, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    after, _ = row_logprobs(scorer, rows, 0, 64)  # the adapter is on again after the reference pass
    assert all(torch.equal(a, b) for a, b in zip(after, now))
    with pytest.raises(ConfigError, match="needs a LoRA policy"):
        reference_logprobs(TokenLogProbs(frozen_copy), rows, 0, 64)


def test_checkpoint_round_trip_resumes_exactly(tok, tmp_path):
    rows = _rows()
    settings = LoraSettings(enabled=True, rank=4, alpha=8.0, dropout=0.1)  # dropout: the RNG state matters too
    full = _lora_model(tok, settings)
    torch.manual_seed(7)
    _train_adapter(full, rows, steps=3)

    cut = _lora_model(tok, settings)
    torch.manual_seed(7)
    opt = _train_adapter(cut, rows, steps=1)
    path = tmp_path / "step_1.pt"
    torch.save({**lora_checkpoint_state(cut, opt, settings), "rng": torch.get_rng_state()}, path)
    assert path.stat().st_size < 100_000  # adapter (2 x 4 x 4096 / 8 floats) + AdamW moments, no base weights

    torch.manual_seed(999)  # a fresh process: other adapter init, other RNG
    resumed = apply_lora(make_tiny_model(tok), settings)
    opt2 = torch.optim.AdamW([p for p in resumed.parameters() if p.requires_grad], lr=0.05)
    state = torch.load(path, weights_only=False)
    load_lora_checkpoint_state(resumed, opt2, state, settings)
    torch.set_rng_state(state["rng"])
    scorer = TokenLogProbs(resumed, chunk_tokens=4)
    for _ in range(2):
        opt2.zero_grad(set_to_none=True)
        mini_batch_backward(scorer, rows, torch.tensor([1.0, 1.0, -1.0, -1.0]), None, None, LossSettings(kl_coef=0.0), 0, 64)
        opt2.step()
    a, b = dict(full.named_parameters()), dict(resumed.named_parameters())
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)
    assert not torch.equal(a[next(k for k in a if "lora_B" in k)], torch.zeros(1))


def test_resume_refuses_another_kind_or_settings(tok):
    lora = LoraSettings(enabled=True, rank=8, target_modules=("q_proj", "v_proj"))
    with pytest.raises(ConfigError, match="holds a full fine-tuning run .* asks for LoRA"):
        check_resume_kind(None, lora, "step_000002.pt")
    saved = {"enabled": True, "rank": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    with pytest.raises(ConfigError, match=r"holds a LoRA run \(rank 8, targets \['q_proj', 'v_proj'\]\).*full fine-tuning"):
        check_resume_kind(saved, LoraSettings(), "step_000002.pt")
    check_resume_kind(saved, lora)  # the same settings (targets as a list, as read back from a checkpoint)
    check_resume_kind(None, LoraSettings())
    with pytest.raises(ConfigError) as e:
        check_resume_kind(saved, LoraSettings(enabled=True, rank=4, target_modules=("q_proj",)), "ck.pt")
    assert "model.lora.rank: 8 -> 4; model.lora.target_modules: ['q_proj', 'v_proj'] -> ('q_proj',)" in str(e.value)
    model = _lora_model(tok, LoraSettings(enabled=True))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    state = lora_checkpoint_state(model, opt, LoraSettings(enabled=True))
    other_base = _lora_model(tok, LoraSettings(enabled=True), seed=1)
    with pytest.raises(ConfigError, match="other base weights"):
        load_lora_checkpoint_state(other_base, opt, state, LoraSettings(enabled=True))



def test_init_from_warm_starts_the_adapter_and_refuses_what_does_not_fit(tok, tmp_path):
    from memagent.train.lora import base_fingerprint, load_init_adapter
    from memagent.train.policy import load_policy

    settings = LoraSettings(enabled=True, rank=4, alpha=8.0)
    trained = _lora_model(tok, settings)
    torch.manual_seed(7)
    _train_adapter(trained, _rows(), steps=2)
    ckpt = tmp_path / "step_000002.pt"  # the layout the trainer writes (Trainer.save_checkpoint)
    torch.save({"step": 2, "model": {"adapter": adapter_state_dict(trained), "base_fingerprint": base_fingerprint(trained)},
                "optimizer": {}}, ckpt)

    cfg = load_config(None, ["model.path=tiny", "model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8",
                             f"model.lora.init_from={ckpt}"])
    torch.manual_seed(999)  # peft's own init would differ from the trained adapter
    warm, _ = load_policy(cfg)
    a, b = dict(trained.named_parameters()), dict(warm.named_parameters())
    lora_b = [k for k in a if "lora_B" in k]
    assert lora_b and all(a[k].abs().sum() > 0 for k in lora_b)  # trained: B moved away from peft's zeros
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)

    assert load_init_adapter(_lora_model(tok, settings), str(ckpt)) == {"step": 2, "base_fingerprint": base_fingerprint(trained)}
    with pytest.raises(ConfigError, match="other base weights"):
        load_init_adapter(_lora_model(tok, settings, seed=1), str(ckpt))
    with pytest.raises(ConfigError, match="another LoRA rank"):
        load_init_adapter(_lora_model(tok, LoraSettings(enabled=True, rank=8)), str(ckpt))
    with pytest.raises(ConfigError, match="is not a file"):
        load_init_adapter(warm, str(tmp_path / "missing.pt"))
    torch.save({"step": 1, "model": {"w": torch.zeros(1)}}, tmp_path / "full.pt")
    with pytest.raises(ConfigError, match="not a LoRA training checkpoint"):
        load_init_adapter(warm, str(tmp_path / "full.pt"))
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_init_adapter(warm, str(tmp_path / "junk.pt"))
    with pytest.raises(ConfigError, match="needs model.lora.enabled"):
        load_policy(load_config(None, ["model.path=tiny", f"model.lora.init_from={ckpt}"]))
    # a checkpoint records its LoRA settings: another alpha (the same shapes at another scale, which loaded and
    # doubled the adapter's effect) or other targets are named as such
    import dataclasses

    saved = torch.load(ckpt, weights_only=False)
    torch.save({**saved, "lora": dataclasses.asdict(settings)}, tmp_path / "with_settings.pt")
    assert load_init_adapter(_lora_model(tok, settings), str(tmp_path / "with_settings.pt"))["step"] == 2
    with pytest.raises(ConfigError, match=r"other LoRA settings \(model.lora.alpha: the checkpoint's 8.0, this run's 16.0\)"):
        load_init_adapter(_lora_model(tok, LoraSettings(enabled=True, rank=4, alpha=16.0)), str(tmp_path / "with_settings.pt"))
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: the checkpoint's \[.*\], this run's \['q_proj', 'v_proj'\]"):
        load_init_adapter(_lora_model(tok, LoraSettings(enabled=True, rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))),
                          str(tmp_path / "with_settings.pt"))


def test_init_from_takes_an_exported_adapter_gguf_back_exactly(tok, tmp_path):
    pytest.importorskip("gguf")
    from memagent.export.gguf_lora import write_peft_lora_gguf
    from memagent.train.lora import base_fingerprint, load_init_adapter

    settings = LoraSettings(enabled=True, rank=4, alpha=8.0)
    trained = _lora_model(tok, settings)
    torch.manual_seed(7)
    _train_adapter(trained, _rows(), steps=2)
    path = write_peft_lora_gguf(trained, tmp_path / "adapter.gguf")  # float32; q/k rows in llama.cpp's order
    torch.manual_seed(999)
    warm = _lora_model(tok, settings)
    assert load_init_adapter(warm, path) == {"step": None, "base_fingerprint": base_fingerprint(warm)}
    a, b = dict(trained.named_parameters()), dict(warm.named_parameters())
    q_b = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.default.weight"
    assert a[q_b].abs().sum() > 0  # trained away from peft's zeros, and its rows come back un-permuted
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)

    with pytest.raises(ConfigError, match="adapter alpha 8.0, this run's LoRA gives 16.0"):
        load_init_adapter(_lora_model(tok, LoraSettings(enabled=True, rank=4, alpha=16.0)), path)
    with pytest.raises(ConfigError, match="another LoRA rank"):
        load_init_adapter(_lora_model(tok, LoraSettings(enabled=True, rank=8, alpha=8.0)), path)
    with pytest.raises(ConfigError, match="adapts modules this LoRA does not target"):
        load_init_adapter(_lora_model(tok, LoraSettings(enabled=True, rank=4, alpha=8.0, target_modules=("q_proj",))),
                          path)
    (tmp_path / "junk.gguf").write_bytes(b"GGUF but not really")
    with pytest.raises(ConfigError, match="not a readable GGUF"):
        load_init_adapter(warm, str(tmp_path / "junk.gguf"))
    with pytest.raises(ConfigError, match="no packaged policy 'ruler-niahh'; did you mean 'ruler-niah'"):
        load_init_adapter(warm, "ruler-niahh")
