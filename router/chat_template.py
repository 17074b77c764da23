"""The chat template the router renders conversations with: the model's own, or one the operator names
(`router.chat_template`, vLLM's `--chat-template`): a template shipped in router/templates/ by name, or a Jinja file.

NOTE: the router alone renders chat prompts (workers get token ids), so the option lives in the router's settings;
the same template serves HTTP, gRPC and /tokenize.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

TEMPLATES_DIR = pathlib.Path(__file__).resolve().parent / "templates"


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How the router renders chats and reads tool calls (from the `router:` section)."""

    template: str | None = None  # Jinja text used instead of the model's own template; None: the model's
    tool_call_parser: str | None = None  # router/tool_parsers.py PARSERS name; None: tool_choice "auto" is refused


def shipped_templates() -> list[str]:
    """The names of the templates shipped with pdcluster."""
    return sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))


def template_path(value: str) -> pathlib.Path:
    """The file a `router.chat_template` value names (a shipped name, or a path); ValueError if there is none."""
    if value in shipped_templates():
        return TEMPLATES_DIR / f"{value}.jinja"
    path = pathlib.Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"no such file {value!r}, and not a shipped template ({', '.join(shipped_templates())})")
    return path


def load_chat_template(value: str) -> str:
    """The Jinja text a `router.chat_template` value names; ValueError if it cannot be read or compiled."""
    import jinja2

    path = template_path(value)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{path}:{e.lineno}: not a Jinja template: {e.message}") from None
    return text
