"""YAML with its line numbers: parse a deploy file, find the line of a field path, and report problems there."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

__all__ = ["ConfigError", "ConfigIssue", "line_of", "parse"]


@dataclass(frozen=True)
class ConfigIssue:
    """One problem in a config: the field path ("" for the whole file), its 1-based line if known, and what is wrong."""

    path: str
    line: int | None
    message: str


class ConfigError(ValueError):
    """A deploy config that cannot be used; `path`, `line` and `source` locate its first problem."""

    def __init__(self, source: str, issues: Sequence[ConfigIssue]) -> None:
        assert issues, "a ConfigError needs at least one issue"
        # NOTE: sorted by line so the first one reported is the first one an operator meets reading the file.
        self.issues = tuple(sorted(issues, key=lambda i: (i.line is None, i.line or 0)))
        self.source = source
        self.path, self.line = self.issues[0].path, self.issues[0].line
        super().__init__("\n".join(_format_issue(source, i) for i in self.issues))


def _format_issue(source: str, issue: ConfigIssue) -> str:
    where = source if issue.line is None else f"{source}:{issue.line}"
    return f"{where}: {issue.path}: {issue.message}" if issue.path else f"{where}: {issue.message}"


def parse(text: str, source: str) -> tuple[yaml.Node | None, Any]:
    """The YAML node tree (for line numbers) and the data built from that same tree."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _check_duplicate_keys(node, (), source, set())
        data = None if node is None else loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = ": ".join(filter(None, [exc.context, exc.problem]))
        raise ConfigError(source, [ConfigIssue("", mark.line + 1 if mark else None,
                                               f"invalid YAML: {problem}")]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, [ConfigIssue("", None, f"invalid YAML: {exc}")]) from None
    finally:
        loader.dispose()
    if data is not None and not isinstance(node, yaml.MappingNode):
        kind = "a list" if isinstance(node, yaml.SequenceNode) else f"the value {data!r}"
        raise ConfigError(source, [ConfigIssue("", node.start_mark.line + 1,
                                               f"the top level must be a mapping of sections, got {kind}")])
    return node, data


def _check_duplicate_keys(node: yaml.Node, path: tuple[str, ...], source: str, seen: set[int]) -> None:
    # NOTE: PyYAML keeps the last of two equal keys without a word; a second `prefill:` would silently win.
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first_line: dict[str, int] = {}
        for key, value in node.value:
            name = str(key.value)
            if isinstance(key, yaml.ScalarNode) and name != "<<":
                if name in first_line:
                    raise ConfigError(source, [ConfigIssue(".".join((*path, name)), key.start_mark.line + 1,
                                                           f"duplicate key (first on line {first_line[name]})")])
                first_line[name] = key.start_mark.line + 1
            _check_duplicate_keys(value, (*path, name), source, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_duplicate_keys(item, (*path, str(i)), source, seen)


def line_of(root: yaml.Node | None, loc: tuple[str | int, ...]) -> int | None:
    """1-based line of the deepest node along `loc`: a key's own line, else its mapping's (e.g. a missing field)."""
    if root is None:
        return None
    node, line = root, root.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == str(part)),
                         None)
            if match is None:
                break
            node, line = match[1], match[0].start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line
