"""bfloat16 compute over float32 master weights: what runs in which dtype, and how close it stays."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memagent.errors import ConfigError  # noqa: E402
from memagent.train.batching import TokenLogProbs, pad_rows  # noqa: E402
from memagent.train.precision import compute_autocast, native_bfloat16, resolve_compute_dtype  # noqa: E402
from memagent.train.rollout import Row  # noqa: E402
from memagent.train.tiny import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_unknown_compute_dtype_is_refused():
    with pytest.raises(ConfigError, match="model.compute_dtype must be one of float32, bfloat16, got 'float16'"):
        compute_autocast("float16")
    with pytest.raises(ConfigError, match="compute_dtype"):
        TokenLogProbs(torch.nn.Linear(1, 1), compute_dtype="fp8")


def test_bfloat16_matmuls_float32_softmax_and_master_weights(tiny):
    _, tok = tiny
    model = make_tiny_model(tok, seed=1)
    seen = {}

    def record(name):
        def hook(module, inputs, output):
            seen.setdefault(name, output.dtype)
        return hook

    model.lm_head.register_forward_hook(record("head"))
    model.model.layers[0].self_attn.q_proj.register_forward_hook(record("q"))
    g = torch.Generator().manual_seed(0)
    rows = [Row(tuple(torch.randint(3, 300, (9,), generator=g).tolist()), (5, 6, 7, 8), 0, 0, True),
            Row(tuple(torch.randint(3, 300, (6,), generator=g).tolist()), (9, 10), 1, 0, True)]
    b = pad_rows(rows, 0)
    out = {}
    for dtype in ("float32", "bfloat16"):
        seen.clear()
        model.zero_grad(set_to_none=True)
        lp, ent = TokenLogProbs(model, 4, compute_dtype=dtype)(b.input_ids, b.attention_mask, True, b.response_mask)
        (lp * b.response_mask).sum().backward()
        out[dtype] = (lp, ent, torch.cat([p.grad.flatten() for p in model.parameters()]), dict(seen))
    assert out["float32"][3] == {"head": torch.float32, "q": torch.float32}
    assert out["bfloat16"][3] == {"head": torch.bfloat16, "q": torch.bfloat16}
    lp32, ent32, g32, _ = out["float32"]
    lp16, ent16, g16, _ = out["bfloat16"]
    assert lp16.dtype == ent16.dtype == torch.float32  # log-softmax in float32
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    m = b.response_mask.bool()
    assert 0 < float((lp16 - lp32)[m].abs().max()) < 0.05  # bfloat16 rounding, not another function
    assert float(torch.nn.functional.cosine_similarity(g16, g32, dim=0)) > 0.99


def test_native_bfloat16_reads_the_cpu_flags(tmp_path):
    with_bf16, without = tmp_path / "a", tmp_path / "b"
    with_bf16.write_text("processor: 0\nflags\t\t: fpu avx512f avx512_bf16 avx512_vnni\n")
    without.write_text("processor: 0\nflags\t\t: fpu avx2 avx512f\n")
    assert native_bfloat16("cpu", str(with_bf16)) is True
    assert native_bfloat16("cpu", str(without)) is False
    assert native_bfloat16("cpu", str(tmp_path / "missing")) is False


def test_auto_compute_dtype_picks_bfloat16_only_where_the_device_has_it(recwarn):
    assert resolve_compute_dtype("auto", "cpu", native=True) == "bfloat16"
    assert resolve_compute_dtype("auto", "cpu", native=False) == "float32"
    assert resolve_compute_dtype("float32", "cpu", native=True) == "float32"
    assert resolve_compute_dtype("bfloat16", "cpu", native=True) == "bfloat16"
    assert len(recwarn) == 0
    with pytest.warns(UserWarning, match="without native bfloat16 .*set model.compute_dtype=auto or float32"):
        assert resolve_compute_dtype("bfloat16", "cpu", native=False) == "bfloat16"  # forced: kept, with a warning
    with pytest.raises(ConfigError, match="must be one of auto, float32, bfloat16, got 'bf16'"):
        resolve_compute_dtype("bf16")


def test_lora_on_a_bfloat16_base_under_autocast(tiny):
    pytest.importorskip("peft")
    from memagent.train.lora import LoraSettings, apply_lora

    _, tok = tiny
    torch.manual_seed(0)
    model = apply_lora(make_tiny_model(tok, seed=1).to(torch.bfloat16), LoraSettings(enabled=True, rank=4))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    ids, am = torch.tensor([[5, 6, 7, 8, 9, 10]]), torch.ones(1, 6, dtype=torch.long)
    plain, _ = TokenLogProbs(model)(ids, am)  # no autocast: peft casts the bfloat16 input for the float32 adapter
    lp, _ = TokenLogProbs(model, compute_dtype="bfloat16")(ids, am)  # autocast: no input casts
    lp.sum().backward()
    assert float((lp - plain).abs().max()) < 0.05
    layers = [m for m in model.modules() if hasattr(m, "cast_input_dtype_enabled")]
    assert layers and all(m.cast_input_dtype_enabled for m in layers)  # restored after the forward
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
