"""The output-file checks of `memagent run` and `demo` (memagent.runfiles.outputs)."""

import os
from pathlib import Path

import pytest

from memagent.errors import MemagentError
from memagent.runfiles.outputs import check_paths, file_option


def test_a_trailing_slash_names_a_folder_not_a_file():
    assert file_option(None, "--trace", "trace.jsonl") is None
    assert file_option("runs/t.jsonl", "--trace", "trace.jsonl") == Path("runs/t.jsonl")
    for value, suggestion in (("runs/x/", "runs/x/trace.jsonl"), ("/", "/trace.jsonl"), ("x//", "x/trace.jsonl")):
        with pytest.raises(MemagentError, match=f"--trace {value} ends with a slash, so it names a folder; give a "
                                                f"file path, e.g. --trace {suggestion}$"):
            file_option(value, "--trace", "trace.jsonl")


def test_a_dot_names_a_folder_too():
    for value, suggestion in (("newd/.", "newd/p.jsonl"), (".", "p.jsonl"), ("a/..", "a/../p.jsonl")):
        with pytest.raises(MemagentError, match=f"^--output {value} names a folder; give a file path, e.g. "
                                                f"--output {suggestion}$"):
            file_option(value, "--output", "p.jsonl")


def test_a_dash_is_not_taken_for_a_file_named_dash():
    with pytest.raises(MemagentError, match="^--output - does not write to stdout: give a file path; without --output "
                                            "the predictions are printed"):
        file_option("-", "--output", "predictions.jsonl")
    with pytest.raises(MemagentError, match="^--trace - does not write to stdout: give a file path$"):
        file_option("-", "--trace", "trace.jsonl")


def test_the_check_opens_the_file_and_leaves_nothing_behind(tmp_path):
    new, old = tmp_path / "new.jsonl", tmp_path / "old.jsonl"
    old.write_text("kept\n")
    check_paths({}, {"--output": new, "--trace": old})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.jsonl"] and old.read_text() == "kept\n"


@pytest.mark.skipif(not os.path.isfile("/proc/version"), reason="needs Linux /proc")
def test_a_file_that_refuses_writes_is_named_even_for_root():
    """As root, os.access calls /proc/version writable; opening it for appending fails, before any reading."""
    with pytest.raises(MemagentError, match="^cannot write --trace /proc/version: "):
        check_paths({}, {"--trace": Path("/proc/version")})
