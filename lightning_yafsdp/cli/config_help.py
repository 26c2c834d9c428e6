"""Every recipe key with its type, default and description, for ``yafsdp train --help``.

Read from the schema itself (the dataclasses of ``config.py`` and the
``Attributes:`` sections of their docstrings), so the help cannot drift from
what ``load_config`` accepts: a key without a description fails a test.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Iterator
from typing import Any

from lightning_yafsdp.config import RunConfig


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One recipe key: ``name`` (dotted), ``type``, ``default`` (as YAML would show
    it) and the first sentence of its description."""

    name: str
    type: str
    default: str
    description: str


def config_keys(cls: Any = RunConfig, prefix: str = "") -> Iterator[ConfigKey]:
    """Every leaf key of the schema, in declaration order."""
    hints = typing.get_type_hints(cls)
    docs = attribute_docs(cls)
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            yield from config_keys(hint, f"{prefix}{field.name}.")
            continue
        yield ConfigKey(
            name=f"{prefix}{field.name}",
            type=_type_name(hint),
            default=_default_of(field),
            description=docs.get(field.name, ""),
        )


def attribute_docs(cls: Any) -> dict[str, str]:
    """``{attribute: first sentence}`` from a Google-style ``Attributes:`` section.

    An entry starts at the section's indent (4 spaces); its names run to the first
    colon, over several lines if need be (``a, b,`` / ``c: text`` describes all three);
    deeper-indented lines continue its text.
    """
    doc = inspect.getdoc(cls) or ""
    if "Attributes:" not in doc:
        return {}
    entries: list[tuple[str, str]] = []  # (names, text)
    for line in doc.split("Attributes:", 1)[1].splitlines():
        indent = len(line) - len(line.lstrip())
        if line.strip() and indent == 0:
            break  # the next section
        if indent == 4 and (not entries or ":" in entries[-1][0] or entries[-1][1]):
            entries.append((line.strip(), ""))
        elif indent == 4:  # more names of an entry whose colon is still to come
            entries[-1] = (f"{entries[-1][0]} {line.strip()}", "")
        elif entries and line.strip():
            names, text = entries[-1]
            entries[-1] = (names, f"{text} {line.strip()}")
    docs: dict[str, str] = {}
    for head, more in entries:
        names, _, text = head.partition(":")
        for name in names.split(","):
            if name.strip():
                docs[name.strip()] = _first_sentence(f"{text} {more}")
    return docs


def render_config_keys() -> str:
    """The ``config keys`` block of ``yafsdp train --help``."""
    keys = list(config_keys())
    width = max(len(k.name) for k in keys)
    lines = ["config keys (KEY=VALUE on the command line, or in a recipe YAML):"]
    section = ""
    for key in keys:
        head = key.name.rsplit(".", 1)[0] if "." in key.name else ""
        if head != section:
            section = head
            lines.append("")
        lines.append(
            f"  {key.name:<{width}}  {key.type} = {key.default}  {key.description}".rstrip()
        )
    return "\n".join(lines)


def _first_sentence(text: str) -> str:
    text = re.sub(r"``([^`]*)``", r"\1", " ".join(text.split()))
    end = re.search(r"\.(\s|$)", text)
    return text[: end.start() + 1] if end else text


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if args and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return f"{_type_name(inner[0])} | null"
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    return getattr(hint, "__name__", str(hint))


def _default_of(field: dataclasses.Field) -> str:
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
    else:
        value = field.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)
