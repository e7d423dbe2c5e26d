"""RULER tasks, registered by name: ``build_ruler_sample(task, length, index, tokenizer)`` builds one sample.

Tasks: niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue, niah_multiquery, vt, cwe, fwe, qa_1, qa_2.
Every sample's RULER input (instruction + context + question) fits ``length - tokens_to_generate`` tokens of
the given tokenizer; memagent's ``Sample.question`` is the instruction and question without the context.
"""

from __future__ import annotations

from collections.abc import Callable

from memagent.registry import Registry
from memagent.tokenization import Tokenizer
from memagent.types import Sample

RULER_TASKS: Registry[Callable[..., Sample]] = Registry("RULER task")

#: RULER's 13 tasks in its own order; MemAgent's OOD set drops cwe and qa_2.
ALL_TASKS = (
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
    "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2",
)
MEMAGENT_TASKS = tuple(t for t in ALL_TASKS if t not in ("cwe", "qa_2"))


def _niah():
    from memagent.data.ruler.niah import build_niah

    return build_niah


def _lazy(module: str, fn: str):
    def load():
        import importlib

        return getattr(importlib.import_module(f"memagent.data.ruler.{module}"), fn)

    return load


for _t in ALL_TASKS[:8]:
    RULER_TASKS.register_lazy(_t, _niah)
RULER_TASKS.register_lazy("vt", _lazy("vt", "build_vt"))
RULER_TASKS.register_lazy("cwe", _lazy("cwe", "build_cwe"))
RULER_TASKS.register_lazy("fwe", _lazy("fwe", "build_fwe"))
RULER_TASKS.register_lazy("qa_1", _lazy("qa", "build_qa"))
RULER_TASKS.register_lazy("qa_2", _lazy("qa", "build_qa"))

#: Metric per task (RULER: all-match for synthetic tasks, part-match for qa).
RULER_METRIC = {t: ("string_match_part" if t.startswith("qa") else "string_match_all") for t in ALL_TASKS}


def build_ruler_sample(
    task: str,
    length: int,
    index: int,
    tokenizer: Tokenizer,
    seed: int = 42,
    haystack: str | None = None,
    data_root: str | None = None,
) -> Sample:
    """One RULER sample.

    Args:
        task: a task name (see :data:`ALL_TASKS`).
        length: target length in tokens (RULER input + tokens to generate).
        index: sample index (also the question index for qa tasks).
        tokenizer: the model's tokenizer.
        seed: base seed; each sample's RNG comes from ``(seed, task, length, index)``.
        haystack: ``gutenberg`` to replace the essay haystack of essay-based NIAH tasks.
        data_root: explicit data root.

    Raises:
        UnknownNameError: unknown task (suggests the closest).
        DataError: the sample cannot be built (missing data, too short a length, too small a pool).
        ConfigError: ``haystack`` is not ``essay``, ``gutenberg`` or None.
    """
    if haystack not in (None, "essay", "gutenberg"):
        from memagent.errors import ConfigError

        raise ConfigError(f"haystack must be essay (the default) or gutenberg, got {haystack!r}")
    return RULER_TASKS.get(task)(task, length, index, tokenizer, seed=seed, haystack=haystack, data_root=data_root)
TASKS = RULER_TASKS  # the name the main CLI lists
