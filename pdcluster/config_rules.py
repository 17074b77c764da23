"""The one exception config validators raise for a cross-field rule: it carries the path of the field it names."""

from __future__ import annotations


class RuleError(ValueError):
    """A cross-field rule broken; `path` is relative to the model whose validator raised it."""

    def __init__(self, path: str, message: str) -> None:
        self.path = tuple(path.split("."))
        super().__init__(message)
