"""One exception tree for the whole package.

Every error raised on bad input names the offending input and says what to do about it.
Callers can catch :class:`MemagentError` to handle anything this package raises on purpose.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class MemagentError(Exception):
    """Base class of every error memagent raises on purpose."""


class ConfigError(MemagentError, ValueError):
    """A setting (or a combination of settings) cannot work; the message names the setting to change."""


class DataError(MemagentError, ValueError):
    """Input data is malformed or missing; the message names the file, line and field where known."""


class BackendError(MemagentError, RuntimeError):
    """A model backend failed to produce a completion.

    Attributes:
        request_id: id of the request that failed, when known.
    """

    def __init__(self, message: str, request_id: str | None = None):
        super().__init__(message if request_id is None else f"[request {request_id}] {message}")
        self.request_id = request_id


class BackendTimeout(BackendError):
    """The backend did not answer within the configured timeout."""


class ContextOverflow(BackendError):
    """The prompt plus the requested new tokens exceed the backend's context window."""


class PromptTruncated(ContextOverflow):
    """The server answered, but from fewer prompt tokens than were sent: it cut the prompt to its own window
    without saying so (its ``usage.prompt_tokens`` is far below the client's own count)."""


class BadResponse(BackendError):
    """The backend answered, but with something that is not a valid completion."""


def closest(name: str, known: Iterable[str]) -> str | None:
    """The known name closest to a misspelled ``name`` (difflib's ratio >= 0.6), or ``None``."""
    close = difflib.get_close_matches(str(name), list(known), n=1)
    return close[0] if close else None


class UnknownNameError(MemagentError, KeyError):
    """A name (backend, task, verifier, loss variant ...) is not registered; suggests the closest one."""

    def __init__(self, kind: str, name: str, known: Iterable[str]):
        known = sorted(known)
        close = closest(name, known)
        hint = f" Did you mean {close!r}?" if close else ""
        super().__init__(f"unknown {kind} {name!r}.{hint} Known: {', '.join(known)}")
        self.kind, self.name, self.known = kind, name, known

    def __str__(self) -> str:  # KeyError would otherwise print the repr with quotes
        return self.args[0]
