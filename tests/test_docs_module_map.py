"""docs/design.md's module map names every module of the package, and only those."""

from __future__ import annotations

from pathlib import Path

import breakgraph

PACKAGE = Path(breakgraph.__file__).parent
DESIGN = PACKAGE.parent / "docs" / "design.md"


def mapped_modules(text: str) -> list[str]:
    """The paths, relative to the package, that the ``## Module map`` block lists: a line
    ``  name/`` opens a folder, the more indented ``name.py`` lines below it are its modules."""
    block = text.split("## Module map", 1)[1].split("```", 2)[1]
    found, folder = [], ""
    for line in block.splitlines()[1:]:
        if not line.strip() or line.strip() == "breakgraph/":
            continue
        indent, name = len(line) - len(line.lstrip()), line.split()[0]
        if name.endswith("/"):
            folder = name
        else:
            found.append((folder if indent > 2 else "") + name)
    return found


def package_modules() -> set[str]:
    return {
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py" or p.parent == PACKAGE
    }


def test_the_map_reader_sees_folders_and_root_modules():
    text = "## Module map\n\n```\nbreakgraph/\n  env.py  knobs\n  server/  http\n    app.py  routes\n  cli.py  cmd\n```\n"
    assert mapped_modules(text) == ["env.py", "server/app.py", "cli.py"]


def test_design_md_maps_every_module_once():
    listed = mapped_modules(DESIGN.read_text())
    assert len(listed) == len(set(listed)), "a module is listed twice"
    missing = sorted(package_modules() - set(listed))
    stale = sorted(set(listed) - package_modules())
    assert not missing, f"docs/design.md's module map lacks {missing}"
    assert not stale, f"docs/design.md's module map lists modules that do not exist: {stale}"
