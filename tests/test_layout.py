"""The package's one-way layering: the library (every module of ``zeropp`` outside ``zeropp.tools``,
the integrations included) never imports the laboratory in ``zeropp.tools``; the tools import the
library, not the other way round. Read from the source with ``ast``, so an import inside a function
counts as much as one at the top."""

from __future__ import annotations

import ast
import pathlib
import re

import zeropp

PACKAGE = pathlib.Path(zeropp.__file__).parent
TOOLS = "zeropp.tools"
TOOLS_NAME = re.compile(r"zeropp\.tools(\.\w+)*(:\w+)?")
"""A string that names a tools module (``importlib.import_module``, ``python -m``, a script target)."""


def module_name(path: pathlib.Path) -> str:
    parts = ("zeropp", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def tools_references(source: str, module: str, is_package: bool = False) -> list[str]:
    """Each import of ``zeropp.tools`` (or of a module in it) in ``source``, and each string naming
    one, as ``line: what``; ``module`` resolves relative imports."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[:len(module.split(".")) - node.level + is_package]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and TOOLS_NAME.fullmatch(node.value):
            names = [node.value]
        if any(name == TOOLS or name.startswith(TOOLS + ".") or name.startswith(TOOLS + ":") for name in names):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def library_modules() -> list[pathlib.Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if path.relative_to(PACKAGE).parts[0] != "tools")


def test_the_library_never_imports_the_tools() -> None:
    modules = library_modules()
    walked = {path.relative_to(PACKAGE).as_posix() for path in modules}
    assert {"__init__.py", "setup/sharding.py", "codes/codec.py", "engine/__init__.py", "checkpoint/export.py",
            "integrations/hf.py", "integrations/torchtitan.py", "hf.py", "torchtitan.py"} <= walked, walked
    offenders = {path.relative_to(PACKAGE).as_posix(): found for path in modules
                 if (found := tools_references(path.read_text(encoding="utf-8"), module_name(path),
                                               path.name == "__init__.py"))}
    assert not offenders, f"library modules that import zeropp.tools (the tools import the library): {offenders}"


def test_every_way_of_importing_the_tools_is_seen() -> None:
    """The check above finds an import of the tools written in any form, at the top or inside a function."""
    imports = ["import zeropp.tools", "import zeropp.tools.modes as modes", "from zeropp import tools",
               "from zeropp.tools import modes", "from zeropp.tools.models.smollm import gguf_path",
               "def f():\n    from zeropp.tools.plan import cost\n", "launch_local('zeropp.tools.demo', [])",
               "SCRIPT = 'zeropp.tools.cli:main'"]
    for source in imports:
        assert tools_references(source, "zeropp.codes.codec"), source
    assert tools_references("from ..tools import modes", "zeropp.codes.codec")
    assert tools_references("from .tools import modes", "zeropp", is_package=True)
    assert tools_references("from . import tools", "zeropp.hf")
    clean = ["import zeropp", "from zeropp.codes import quant", "from zeropp import toolsmith",
             "from . import codec", "'''See zeropp.tools.bench.comm.'''"]
    for source in clean:
        assert not tools_references(source, "zeropp.codes.codec"), source


def imported_modules(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The zeropp modules ``source`` imports, at the top or inside a function (``from x import y``
    counts ``x.y`` where it is a module, else ``x``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[:len(module.split(".")) - node.level + is_package]
                base = ".".join([*anchor, *([base] if base else [])])
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
    return {name for name in found if name in known and name != module}


def test_no_import_cycles() -> None:
    """No zeropp module imports one that imports it back, directly or through others: the
    library, the integrations and the tools all import one way."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    edges = {name: imported_modules(path.read_text(encoding="utf-8"), name, path.name == "__init__.py",
                                    set(paths)) for name, path in paths.items()}
    cycles, done = [], set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            cycles.append(trail[trail.index(name):] + [name])
            return
        if name in done:
            return
        for imported in sorted(edges[name]):
            visit(imported, [*trail, name])
        done.add(name)

    for name in sorted(edges):
        visit(name, [])
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_the_top_level_shows_the_layers() -> None:
    """At most 18 modules at the package's top level; the techniques, FSDP2's plumbing and the
    set-up each in a folder of their own."""
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= 18, top
    folders = {path.name for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    assert {"techniques", "fsdp", "setup"} <= folders
    assert {path.stem for path in (PACKAGE / "techniques").glob("*.py")} >= {"qwz", "hpz", "qgz", "replicas"}
