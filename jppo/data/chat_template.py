"""Rendering of Hugging Face chat templates (Jinja), in the environment ``transformers`` gives them.

Templates ship inside downloaded checkpoints, so they are untrusted code: they run in Jinja's immutable sandbox.
Like ``transformers``, the environment has ``trim_blocks``/``lstrip_blocks``, loop controls (``break``,
``continue``), ``raise_exception(message)``, ``strftime_now(format)``, a ``tojson`` that does not escape HTML, and
accepts ``{% generation %}`` blocks (rendered as their body).
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change what the model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def compile_template(source: str) -> jinja2.Template:
    """The compiled chat template ``source``; render it with ``messages``, ``add_generation_prompt`` and tokens."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return environment.from_string(source)
