"""Chat-template rendering that keeps message contents as plain text.

A document may contain strings such as ``<|im_start|>`` or ``</s>``. If the rendered prompt were tokenized
as one string with special tokens enabled, those strings would become control tokens. In-process
backends therefore render the model's chat template with placeholder sentinels in place of each message's
content, tokenize the template's own text with special tokens enabled and each content with special
tokens disabled, and concatenate the ids. The same pieces give the same ids in inference and training.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from memagent.errors import ConfigError
from memagent.types import Message

_SENTINEL = "\x00MEMAGENT_CONTENT_{}\x00"


def render_pieces(
    messages: Sequence[Message],
    render: Callable[[list[dict[str, str]]], str],
) -> list[tuple[str, bool]]:
    """Render a chat and return its pieces in order.

    Args:
        messages: the conversation.
        render: renders a list of ``{"role", "content"}`` dicts to the prompt string (the model's chat
            template with the generation prompt added).

    Returns:
        ``[(text, is_content), ...]``: template text (``is_content=False``, tokenize with special tokens)
        and message contents (``is_content=True``, tokenize as plain text). Concatenated, the texts are the
        rendered prompt.

    Raises:
        ConfigError: the template dropped or altered a message's content (e.g. it strips whitespace), so
            contents cannot be located.
    """
    placeholder = [{"role": m.role, "content": _SENTINEL.format(i)} for i, m in enumerate(messages)]
    rendered = render(placeholder)
    pieces: list[tuple[str, bool]] = []
    rest = rendered
    for i, m in enumerate(messages):
        s = _SENTINEL.format(i)
        head, sep, rest = rest.partition(s)
        if not sep:
            raise ConfigError(
                f"the chat template did not reproduce message {i} ({m.role}) verbatim; memagent cannot keep "
                "document text apart from control tokens with this template. Pass a plain template instead."
            )
        if head:
            pieces.append((head, False))
        pieces.append((m.content, True))
    if rest:
        pieces.append((rest, False))
    return pieces


def encode_pieces(
    pieces: Sequence[tuple[str, bool]],
    encode_template: Callable[[str], list[int]],
    encode_content: Callable[[str], list[int]],
) -> list[int]:
    """Token ids of rendered pieces: template text with ``encode_template`` (special tokens parsed),
    contents with ``encode_content`` (special-looking text kept as plain text)."""
    ids: list[int] = []
    for text, is_content in pieces:
        if text:
            ids.extend(encode_content(text) if is_content else encode_template(text))
    return ids


def messages_as_dicts(messages: Sequence[Message]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]
