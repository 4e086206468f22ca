"""docs/layout.md is the package's tree, one line per module, and no module of the package is over 400 lines."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYOUT = ROOT / "docs" / "layout.md"
MAX_LINES = 400


def listed_modules(text: str) -> list[str]:
    """The module paths of the first code block of ``text``: a line ``name/`` opens a folder, a line ``name.py ...``
    is a module, and two spaces of indentation are one level."""
    block = re.search(r"^```\n(.*?)^```", text, re.M | re.S)[1]
    folders: list[str] = []
    modules = []
    for line in filter(str.strip, block.splitlines()):
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        folders = folders[:depth]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        else:
            modules.append("/".join([*folders, name]))
    return modules


def package_modules() -> set[str]:
    return {str(p.relative_to(ROOT)) for p in (ROOT / "jppo").rglob("*.py")}


def test_the_layout_lists_every_module_once_and_nothing_else():
    listed = listed_modules(LAYOUT.read_text())
    assert len(listed) == len(set(listed)), sorted({m for m in listed if listed.count(m) > 1})
    missing, gone = package_modules() - set(listed), set(listed) - package_modules()
    assert not missing and not gone, f"docs/layout.md lacks {sorted(missing)} and lists missing {sorted(gone)}"


def test_the_parser_reads_folders_and_modules_by_indentation():
    text = "```\njppo/\n  a.py   x\n  b/\n    c.py  y\n  d.py\n```\n"
    assert listed_modules(text) == ["jppo/a.py", "jppo/b/c.py", "jppo/d.py"]


def test_no_module_is_over_the_line_limit():
    sizes = {m: len((ROOT / m).read_text().splitlines()) for m in package_modules()}
    assert not {m: n for m, n in sizes.items() if n > MAX_LINES}, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
