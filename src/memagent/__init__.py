"""memagent: answer questions over documents of any length with a fixed-size text memory (MemAgent)."""

__version__ = "0.1.0"
