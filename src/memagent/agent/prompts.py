"""Prompt templates of the memory agent: one for memory updates, one for the final answer.

Structure (reference doc section 1.3, kept because it is an interface fact of trained checkpoints): an
instruction, then tagged sections ``<problem>`` (the question), ``<memory>`` (the previous memory) and, for
updates, ``<section>`` (the current chunk), then a cue line. The wording is memagent's own; a YAML file with
keys ``update``, ``final``, ``no_memory`` and optional ``system`` replaces it (see
``agent/templates/default.yaml``). The templates' hash is recorded with every result.

Slots are filled in a single pass, so text inside a question, memory or chunk that looks like a slot
(``{memory}``) or like LaTeX braces is inserted verbatim and never re-substituted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from importlib import resources

import yaml

from memagent.configtypes import load_yaml
from memagent.errors import ConfigError
from memagent.types import Message

_SLOT = re.compile(r"\{(question|memory|chunk)\}")


def _fill(template: str, values: dict[str, str]) -> str:
    return _SLOT.sub(lambda m: values[m.group(1)], template)


@dataclass(frozen=True)
class PromptTemplates:
    """The agent's prompts.

    Attributes:
        update: memory-update template with slots ``{question}``, ``{memory}``, ``{chunk}``.
        final: final-answer template with slots ``{question}``, ``{memory}`` (no chunk: the answer is made from
            the memory alone).
        no_memory: the memory text shown before the first chunk (and whenever the memory is empty).
        system: optional system message sent before every user message (``None``: the chat template's default).

    Raises:
        ConfigError: a template lacks a required slot, holds one twice, or the final template asks for a chunk.
    """

    update: str
    final: str
    no_memory: str = "No previous memory"
    system: str | None = None

    def __post_init__(self):
        for name in ("update", "final", "no_memory", "system"):
            value = getattr(self, name)
            if not isinstance(value, str) and not (name == "system" and value is None):
                raise ConfigError(f"prompt template field {name!r} must be text, got {type(value).__name__}")
        for name, tpl, need in (("update", self.update, ("question", "memory", "chunk")), ("final", self.final, ("question", "memory"))):
            missing = [s for s in need if "{" + s + "}" not in tpl]
            if missing:
                raise ConfigError(f"the {name} template lacks the slot(s) {', '.join('{' + s + '}' for s in missing)}")
        if "{chunk}" in self.final:
            raise ConfigError("the final template must not contain {chunk}: the answer is made from the memory alone")
        for name, tpl in (("update", self.update), ("final", self.final)):
            twice = sorted({m for m in _SLOT.findall(tpl) if _SLOT.findall(tpl).count(m) > 1})
            if twice:  # the budget check counts each slot's text once, so a repeated one could overflow the window
                raise ConfigError(f"the {name} template holds {', '.join('{' + s + '}' for s in twice)} more than once; "
                                  "each slot may appear once (the token budget counts it once)")

    @property
    def hash(self) -> str:
        """First 12 hex digits of the SHA-256 of the four fields (canonical JSON)."""
        blob = json.dumps([self.update, self.final, self.no_memory, self.system], ensure_ascii=False)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:12]

    def _memory(self, memory: str | None) -> str:
        return memory if memory else self.no_memory

    def render_update(self, question: str, memory: str | None, chunk: str) -> str:
        """The update prompt's user text; an empty or ``None`` memory shows ``no_memory``."""
        return _fill(self.update, {"question": question, "memory": self._memory(memory), "chunk": chunk})

    def render_final(self, question: str, memory: str | None) -> str:
        """The final prompt's user text; an empty or ``None`` memory shows ``no_memory``."""
        return _fill(self.final, {"question": question, "memory": self._memory(memory)})

    def _wrap(self, text: str) -> tuple[Message, ...]:
        if self.system is None:
            return (Message("user", text),)
        return (Message("system", self.system), Message("user", text))

    def messages_update(self, question: str, memory: str | None, chunk: str) -> tuple[Message, ...]:
        return self._wrap(self.render_update(question, memory, chunk))

    def messages_final(self, question: str, memory: str | None) -> tuple[Message, ...]:
        return self._wrap(self.render_final(question, memory))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> PromptTemplates:
        """Load templates from a YAML (or JSON) file with keys update, final, no_memory, system, or one of the
        templates shipped with memagent by name (:data:`BUILTIN_TEMPLATES`: ``default``, ``chunk_first``) when no
        file of that name exists.

        Raises:
            ConfigError: the file is missing, unreadable, or lacks ``update``/``final``.
        """
        if isinstance(path, str) and path in BUILTIN_TEMPLATES and not os.path.exists(path):
            return _load_builtin(path)
        try:
            with open(path, encoding="utf-8") as f:
                data = load_yaml(f)
        except OSError as e:
            raise ConfigError(f"cannot read prompt templates {os.fspath(path)!r}: {e}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"prompt templates {os.fspath(path)!r} are not valid YAML: {e}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"prompt templates {os.fspath(path)!r} are not UTF-8 text ({e.reason} at byte "
                              f"{e.start}); re-encode the file as UTF-8") from None
        if not isinstance(data, dict) or not {"update", "final"} <= data.keys():
            raise ConfigError(f"prompt templates {os.fspath(path)!r} need the keys 'update' and 'final'")
        unknown = set(data) - {"update", "final", "no_memory", "system"}
        if unknown:
            raise ConfigError(f"prompt templates {os.fspath(path)!r} have unknown keys {sorted(unknown)}")
        return cls(**data)


#: Templates shipped in ``memagent/agent/templates/``: ``default`` (the reference's order: problem, memory,
#: section) and ``chunk_first`` (problem, section, memory: the G rollouts of a question that read the same chunk
#: share every prompt token before the memory, so that prefix can be computed once per group).
BUILTIN_TEMPLATES = ("default", "chunk_first")


def _load_builtin(name: str) -> PromptTemplates:
    text = resources.files("memagent.agent").joinpath(f"templates/{name}.yaml").read_text(encoding="utf-8")
    return PromptTemplates(**yaml.safe_load(text))


DEFAULT_TEMPLATES = _load_builtin("default")
