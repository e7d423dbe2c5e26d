"""memagent.backends.models: the model specs of the llama.cpp backends (smollm2, smollm2-f16, a path) and the cached
F16 copy."""

import json
import os

import numpy as np
import pytest

import memagent.backends.models as embedded
import memagent.backends.gguf_copy as gguf_model
from memagent.errors import ConfigError


@pytest.fixture
def fake_writer(monkeypatch):
    """write_dequantized_gguf replaced by one that writes a marker and counts its calls."""
    calls = []

    def write(src, path, dtype="f16"):
        calls.append((src, path, dtype))
        with open(path, "wb") as f:
            f.write(b"F16 copy of " + os.path.basename(src).encode())
        return path

    monkeypatch.setattr(gguf_model, "write_dequantized_gguf", write)
    return calls


def test_the_copy_is_written_once_and_rewritten_when_its_source_changes(tmp_path, fake_writer):
    src = tmp_path / "model.Q4_1.gguf"
    src.write_bytes(b"q" * 10)
    out = embedded.cached_f16_copy(str(src), str(tmp_path / "cache"), "model.F16.gguf")
    assert out == str(tmp_path / "cache" / "model.F16.gguf")
    assert open(out, "rb").read() == b"F16 copy of model.Q4_1.gguf"
    assert json.loads((tmp_path / "cache" / "model.F16.gguf.json").read_text()) == {
        "source": str(src), "source_bytes": 10, "dtype": "f16",
        "source_sha256": "56011e3f63396f612e354d39227bdd1fb87bbaa58a6ae293cad1d7f05c25e617"}
    assert embedded.cached_f16_copy(str(src), str(tmp_path / "cache"), "model.F16.gguf") == out
    assert len(fake_writer) == 1  # reused
    src.write_bytes(b"q" * 11)  # another source file under the same path
    embedded.cached_f16_copy(str(src), str(tmp_path / "cache"), "model.F16.gguf")
    assert len(fake_writer) == 2
    src.write_bytes(b"r" * 11)  # same size, other content
    embedded.cached_f16_copy(str(src), str(tmp_path / "cache"), "model.F16.gguf")
    assert len(fake_writer) == 3


def test_the_same_model_file_installed_twice_shares_one_copy(tmp_path, fake_writer):
    """Two virtual environments with the same shipped file under different paths reuse one cached copy."""
    first, second = tmp_path / "venv1" / "m.gguf", tmp_path / "venv2" / "m.gguf"
    for f in (first, second):
        f.parent.mkdir()
        f.write_bytes(b"same weights")
    out = embedded.cached_f16_copy(str(first), str(tmp_path / "cache"), "m.F16.gguf")
    assert embedded.cached_f16_copy(str(second), str(tmp_path / "cache"), "m.F16.gguf") == out
    assert len(fake_writer) == 1


def test_a_missing_gguf_package_is_named_before_any_work(tmp_path, monkeypatch):
    import sys

    src = tmp_path / "m.gguf"
    src.write_bytes(b"q")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    with pytest.raises(ConfigError, match=r"needs the 'gguf' package: pip install 'memagent\[llamacpp\]'"):
        embedded.cached_f16_copy(str(src), str(tmp_path / "cache"), "m.F16.gguf")
    assert not (tmp_path / "cache").exists()


def test_the_training_engines_copy_keeps_its_old_record_name(tmp_path, fake_writer):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    out = embedded.cached_f16_copy(str(src), str(tmp_path / "rollout"))
    assert out == str(tmp_path / "rollout" / "base-f16.gguf")
    assert sorted(os.listdir(tmp_path / "rollout")) == ["base-f16.gguf", "base-f16.json"]


def test_a_missing_source_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="GGUF model file not found"):
        embedded.cached_f16_copy(str(tmp_path / "none.gguf"), str(tmp_path / "cache"))


def test_specs_resolve_to_the_shipped_file_its_f16_copy_in_the_cache_or_the_path(tmp_path, monkeypatch, fake_writer):
    shipped = tmp_path / "pkg" / embedded.DEFAULT_GGUF
    shipped.parent.mkdir()
    shipped.write_bytes(b"q4")
    monkeypatch.setattr(embedded, "smollm2_gguf_path", lambda: str(shipped))
    monkeypatch.setenv("MEMAGENT_CACHE", str(tmp_path / "cache"))
    assert embedded.resolve_gguf(None) == str(shipped)
    assert embedded.resolve_gguf("smollm2") == str(shipped)
    assert embedded.resolve_gguf("smollm2-f16") == str(tmp_path / "cache" / "SmolLM2-135M-Instruct.F16.gguf")
    assert fake_writer == [(str(shipped), str(tmp_path / "cache" / "SmolLM2-135M-Instruct.F16.gguf"), "f16")]
    assert embedded.resolve_gguf("my/model.gguf") == "my/model.gguf"


def test_the_cache_folder_follows_memagent_cache_then_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMAGENT_CACHE", str(tmp_path / "a"))
    assert embedded.cache_dir() == str(tmp_path / "a")
    monkeypatch.delenv("MEMAGENT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded.cache_dir() == str(tmp_path / "xdg" / "memagent")


def test_a_cache_folder_that_cannot_be_written_is_named(tmp_path, fake_writer):
    """MEMAGENT_CACHE under a file (or a read-only home) was a 105-line NotADirectoryError traceback."""

    src = tmp_path / "model.Q4_1.gguf"
    src.write_bytes(b"q" * 10)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match=r"cannot write the F16 copy of 'model.Q4_1.gguf' into the cache folder "
                                          r"'.*afile/cache' .*set MEMAGENT_CACHE to a folder you can write"):
        embedded.cached_f16_copy(str(src), str(tmp_path / "afile" / "cache"), "model.F16.gguf")


def test_an_interrupted_gguf_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """Ctrl-C while the F16 copy was written left `<name>.tmp<PID>` (up to 271 MB) in the cache for good."""
    gguf = pytest.importorskip("gguf")
    from memagent.backends import gguf_copy

    class Stop(BaseException):
        pass

    def interrupted(self, *args, **kwargs):  # the header is on disk when the interruption comes
        assert [p.name for p in tmp_path.iterdir()] == [f"m.gguf.tmp{os.getpid()}"]
        raise Stop

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", interrupted)
    with pytest.raises(Stop):
        gguf_copy.write_gguf(tmp_path / "m.gguf", [], [("a", np.zeros(4, dtype=np.float32))], "f32")
    assert os.listdir(tmp_path) == []


def test_temporary_copies_of_processes_that_are_gone_are_removed_before_a_new_copy(tmp_path, fake_writer):
    """SIGTERM or SIGKILL ends a process without its cleanup; its `<name>.tmp<PID>` stayed in the cache for good."""
    src = tmp_path / "model.Q4_1.gguf"
    src.write_bytes(b"q" * 10)
    cache = tmp_path / "cache"
    cache.mkdir()
    gone, alive = cache / "model.F16.gguf.tmp999999999", cache / f"model.F16.gguf.tmp{os.getpid()}"
    other = cache / "notes.tmp1"
    for f in (gone, alive, other):
        f.write_bytes(b"partial")
    embedded.cached_f16_copy(str(src), str(cache), "model.F16.gguf")
    assert not gone.exists() and alive.exists() and other.exists()  # a running writer's file and others stay
