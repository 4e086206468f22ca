"""The configuration reference, ``docs/configuration.md``, generated from the schema.

``python -m jppo.config.reference`` rewrites the file. The schema is walked by type from :class:`TrainConfig`: a
field whose type is a dataclass is a section and is walked in turn, any other field is a key, written as its
dotted path (``actor.optim.lr``) with its type and its default. Nothing here names a section class, so a class may
move between modules, or be split into mixins, and the reference follows.

A key's meaning is read from the source, in this order:

1. the comment of the field in the class that declares it (the first class of the MRO whose own annotations
   name it): the comment at the end of its line, else the comment lines right above it;
2. its entry under ``Attributes:`` in the docstring of a class of the MRO;
3. the first sentence of such a docstring that names the key as a literal: ``lr`` (or ``lr: 1e-6``) in
   double backticks.

A class without source (one built by ``dataclasses.make_dataclass``) gives no comment and no docstring.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import pathlib
import re
import textwrap
import tokenize
import types
import typing
from typing import Any, NamedTuple, Optional

from jppo.config import TrainConfig
from jppo.config.applies import applies_to

COMMAND = "python -m jppo.config.reference"
DEFAULT_PATH = pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
# Where a docstring's sentence ends: after . ? or ! and before what can start the next one (a capital, a literal).
_SENTENCE_BREAK = re.compile(r"(?<=[.?!])\s+(?=[A-Z`(:])")


class Key(NamedTuple):
    """One leaf of the schema: ``name`` dotted from the top (``rollout.n``)."""

    name: str
    type: str
    default: str
    meaning: str


class _ClassSource(NamedTuple):
    """What a class's own source says: the comment of each field it declares, and its docstring."""

    comments: dict[str, str]
    docstring: str


def keys(schema: type = TrainConfig, prefix: str = "") -> list[Key]:
    """Every key below ``schema``, in declaration order, sections depth first."""
    hints = typing.get_type_hints(schema)
    found = []
    for field in dataclasses.fields(schema):
        kind, name = hints[field.name], prefix + field.name
        if _is_section(kind):
            found += keys(kind, name + ".")
        else:
            found.append(Key(name, type_name(kind), default_text(field), meaning(schema, field.name)))
    return found


def _is_section(kind: Any) -> bool:
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


def type_name(kind: Any) -> str:
    """``Optional[int]`` as ``int | None``, ``list[str]`` as written, a class by its name."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        named = [type_name(arg) for arg in args if arg is not type(None)]
        return " | ".join(named + (["None"] if type(None) in args else []))
    if origin is not None:
        inner = ", ".join(type_name(arg) for arg in args)
        return f"{origin.__name__}[{inner}]" if inner else origin.__name__
    if kind is Any:
        return "any"
    return getattr(kind, "__name__", str(kind))


def default_text(field: dataclasses.Field) -> str:
    """The default as YAML would write it (``null``, ``true``, ``[a, b]``)."""
    if field.default is not dataclasses.MISSING:
        return _yaml(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return _yaml(field.default_factory())
    return "(required)"


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str) and value == "":
        return "''"
    return str(value)


def meaning(schema: type, name: str) -> str:
    """What the source says ``name`` of ``schema`` means (module docstring, the order); ``""`` if nothing."""
    classes = [cls for cls in schema.__mro__ if dataclasses.is_dataclass(cls)]
    declaring = next(cls for cls in classes if name in vars(cls).get("__annotations__", {}))
    comment = _class_source(declaring).comments.get(name)
    if comment:
        return _markdown(comment)
    docstrings = [_class_source(cls).docstring for cls in classes]
    for finder in (_attribute_entry, _naming_sentence):
        for docstring in docstrings:
            text = finder(docstring, name)
            if text:
                return _markdown(text)
    return ""


@functools.cache
def _class_source(cls: type) -> _ClassSource:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source: a class made at run time
        return _ClassSource({}, "")
    node = ast.parse(source).body[0]
    docstring = ast.get_docstring(node) or ""
    lines = _comment_lines(source)
    comments = {}
    for statement in node.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            comments[statement.target.id] = _field_comment(lines, statement.lineno, statement.end_lineno)
    return _ClassSource(comments, docstring)


def _comment_lines(source: str) -> dict[int, tuple[str, bool]]:
    """Line number -> (the comment's text, whether the line holds nothing else)."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            alone = token.line[: token.start[1]].strip() == ""
            found[token.start[0]] = (token.string.lstrip("#").strip(), alone)
    return found


def _field_comment(lines: dict[int, tuple[str, bool]], first: int, last: int) -> str:
    """The comment at the end of the field's lines, else the block of comment lines right above it."""
    for number in range(first, last + 1):
        if number in lines and not lines[number][1]:
            return lines[number][0]
    above, number = [], first - 1
    while number in lines and lines[number][1]:
        above.insert(0, lines[number][0])
        number -= 1
    return " ".join(above)


def _attribute_entry(docstring: str, name: str) -> str:
    """The text of ``name:`` under a docstring's ``Attributes:`` heading, its deeper-indented lines joined."""
    lines = docstring.splitlines()
    if "Attributes:" not in lines:
        return ""
    entry = []
    for line in lines[lines.index("Attributes:") + 1 :]:
        if not line.startswith(" ") or (entry and not line.startswith(" " * 8)):
            break  # the heading's end, or the entry's
        if entry:
            entry.append(line.strip())
        elif line.strip().startswith(f"{name}: "):
            entry.append(line.strip()[len(name) + 2 :])
    return " ".join(entry)


def _naming_sentence(docstring: str, name: str) -> str:
    """The first sentence of ``docstring`` that names ``name`` in double backticks."""
    for paragraph in re.split(r"\n\s*\n", docstring):
        flat = " ".join(paragraph.split())
        for sentence in _SENTENCE_BREAK.split(flat):
            if re.search(rf"``{re.escape(name)}(:[^`]*)?``", sentence):
                return sentence
    return ""


def _markdown(text: str) -> str:
    """reStructuredText roles (``~`` keeping the last name, as Sphinx does) and literals as Markdown code; outside
    code, ``*`` is escaped (it would start emphasis); pipes are escaped everywhere (they would end a table cell)."""
    text = re.sub(r":[a-z]+:`(~?)([^`]+)`", lambda m: f"``{m.group(2).split('.')[-1] if m.group(1) else m.group(2)}``",
                  text)
    parts = text.replace("``", "`").split("`")
    parts[::2] = [part.replace("*", "\\*") for part in parts[::2]]
    return "`".join(parts).replace("|", "\\|")


def _first_sentence(docstring: str) -> str:
    flat = " ".join(docstring.split("\n\n")[0].split())
    return _markdown(_SENTENCE_BREAK.split(flat)[0]) if flat else ""


def render(schema: type = TrainConfig) -> str:
    """The whole reference page: one table per top-level section."""
    out = [
        "# Configuration reference",
        "",
        f"Generated from the schema by `{COMMAND}`; edit the schema's comments and docstrings, not this file.",
        "Every key can be set in the YAML file or on the command line as `section.key=value`.",
        "The last column says where a key is read when not every run reads it (`jppo/config/applies.py`); a key the",
        "chosen `rollout.engine` does not read is refused when set to other than its default, in one line naming what",
        "to set instead. So is a key of RL runs only in an SFT config (`python -m jppo.sft`'s, "
        "or one that sets an `sft`",
        "key), and an `sft` key in an RL run's (`python -m jppo.train`).",
    ]
    hints, every = typing.get_type_hints(schema), keys(schema)
    for field in dataclasses.fields(schema):
        section = hints[field.name]
        out += ["", f"## `{field.name}`", ""]
        intro = _first_sentence(_class_source(section).docstring) if _is_section(section) else ""
        out += [intro, ""] if intro else []
        out += ["| key | type | default | meaning | applies to |", "| --- | --- | --- | --- | --- |"]
        for key in (key for key in every if key.name.split(".")[0] == field.name):
            cells = [f"`{key.name}`", f"`{_cell(key.type)}`", f"`{_cell(key.default)}`", key.meaning,
                     _cell(applies_to(key.name))]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def main(argv: Optional[list[str]] = None) -> None:
    """Write the reference to the path given, by default ``docs/configuration.md`` of the repository."""
    parser = argparse.ArgumentParser(prog="python -m jppo.config.reference", description=main.__doc__)
    parser.add_argument("path", nargs="?", default=str(DEFAULT_PATH), help="where to write it (a Markdown file)")
    path = pathlib.Path(parser.parse_args(argv).path)  # --help prints this, and writes nothing
    path.write_text(render())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
