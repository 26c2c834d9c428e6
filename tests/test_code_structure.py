"""The structure rules of the package, read from its source (AST), not from running it.

- core/ imports one way: a module imports only from its own layer or a lower one
  (compat <- comm <- optim <- runtime <- plan, docs/design.md "Module map"); type-only
  imports under ``if TYPE_CHECKING`` count, because a type-only cycle is still a cycle a
  reader has to hold in their head.
- core/ knows no model library: no import of transformers or peft (nor a ``sys.modules``
  lookup of one of their modules); model-family knowledge lives in adapters beside it
  (``hf_init.py``, ``pretrained.py``).
- No function of the package is longer than 60 lines (docstrings not counted), except
  the few listed with why.
- docs/design.md's module map names every module of the package, and its note index names
  every ``[Note: ...]`` the code points to.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_yafsdp"
CORE = PACKAGE / "core"
DESIGN = ROOT / "docs" / "design.md"

# Bottom to top. core/__init__.py (the public API) sits above every layer.
CORE_LAYERS = ("compat", "comm", "optim", "runtime", "plan")
_PUBLIC_API = len(CORE_LAYERS)


def _python_files(under: Path) -> list[Path]:
    return sorted(p for p in under.rglob("*.py") if ".venv" not in p.parts)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, *, module: str | None = None) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in ``path``, nested and type-only ones included.

    ``from pkg import name`` yields ``pkg.name``: it may be a submodule. ``module`` names
    the file's module when it is not under the repository (the rule's own self-test).
    """
    module = module or _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _core_layer(dotted: str) -> int | None:
    """Layer index of a ``lightning_yafsdp.core...`` name; None outside core."""
    parts = dotted.split(".")
    if parts[:2] != ["lightning_yafsdp", "core"]:
        return None
    if len(parts) == 2 or parts[2] not in CORE_LAYERS:
        return _PUBLIC_API  # the package itself, or a name it exports
    return CORE_LAYERS.index(parts[2])


def test_core_imports_only_from_its_own_layer_or_below() -> None:
    upward = []
    for path in _python_files(CORE):
        own = _core_layer(_module_name(path))
        for line, name in _imported_modules(path):
            target = _core_layer(name)
            if target is not None and target > own:
                rel = path.relative_to(ROOT)
                upward.append(
                    f"{rel}:{line} ({CORE_LAYERS[own] if own < _PUBLIC_API else 'core'}) "
                    f"imports {name} ({CORE_LAYERS[target] if target < _PUBLIC_API else 'core'})"
                )
    assert not upward, "upward imports inside core/:\n" + "\n".join(upward)


def test_every_core_module_belongs_to_a_layer() -> None:
    loose = [
        str(p.relative_to(CORE))
        for p in _python_files(CORE)
        if p.parent == CORE and p.stem not in ("__init__", *CORE_LAYERS)
    ]
    assert not loose, (
        f"modules of core/ outside every layer: {loose}; move them into one of {CORE_LAYERS}"
    )


def test_the_layer_rule_sees_type_only_and_nested_imports(tmp_path: Path) -> None:
    # The rule is only as good as the import finder: check it on a file built to fool it.
    probe = tmp_path / "probe.py"
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from lightning_yafsdp.core.runtime.engine import YaFSDPEngine\n"
        "def f():\n"
        "    from ..plan import sharding\n"
    )
    probe.write_text(source)
    names = [
        name for _, name in _imported_modules(probe, module="lightning_yafsdp.core.comm.probe")
    ]
    assert "lightning_yafsdp.core.runtime.engine.YaFSDPEngine" in names
    assert "lightning_yafsdp.core.plan.sharding" in names
    assert [_core_layer(n) for n in names[1:]] == [3, 4]


MODEL_LIBRARIES = ("transformers", "peft")


def test_core_imports_no_model_library() -> None:
    found = []
    for path in _python_files(CORE):
        rel = path.relative_to(ROOT)
        found += [
            f"{rel}:{line} imports {name}"
            for line, name in _imported_modules(path)
            if name.split(".")[0] in MODEL_LIBRARIES
        ]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(rf"({'|'.join(MODEL_LIBRARIES)})(\.\w+)+", node.value):
                    found.append(f"{rel}:{node.lineno} names the module {node.value!r}")
    assert not found, "core/ must stay model-library free:\n" + "\n".join(found)


MAX_FUNCTION_LINES = 60
# qualified name -> why it may be longer, for now.
# None today: save_sharded, load_sharded and export_checkpoint (issue 25, wt-ckpt) are
# over 60 lines only with their docstrings.
LONG_FUNCTIONS_ALLOWED: dict[str, str] = {}


def _code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from ``def`` to the function's last line, its docstring not counted.

    Documentation never makes a function too long to read; the code does (a public
    function's Args section alone can pass 60 lines: ``shard_model``).
    """
    lines = function.end_lineno - function.lineno + 1
    first = function.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):
            lines -= first.end_lineno - first.lineno + 1
    return lines


def _function_lengths(path: Path) -> list[tuple[str, int]]:
    """(``Class.method`` or ``function``, code lines) per function, nested ones included."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + child.name, _code_lines(child)))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return found


def test_no_function_is_longer_than_60_lines() -> None:
    too_long = {}
    for path in _python_files(PACKAGE):
        for name, lines in _function_lengths(path):
            key = f"{path.relative_to(PACKAGE)}:{name}"
            if lines > MAX_FUNCTION_LINES and key not in LONG_FUNCTIONS_ALLOWED:
                too_long[key] = lines
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {too_long}"


def test_every_allowed_long_function_still_exists_and_is_long() -> None:
    # An exception outlives its reason silently otherwise.
    lengths = {
        f"{path.relative_to(PACKAGE)}:{name}": lines
        for path in _python_files(PACKAGE)
        for name, lines in _function_lengths(path)
    }
    stale = [k for k in LONG_FUNCTIONS_ALLOWED if lengths.get(k, 0) <= MAX_FUNCTION_LINES]
    assert not stale, f"remove from LONG_FUNCTIONS_ALLOWED (now short or gone): {stale}"


def _design_section(title: str) -> str:
    text = DESIGN.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_design_module_map_names_every_module() -> None:
    module_map = _design_section("Module map")
    missing = [
        str(p.relative_to(PACKAGE))
        for p in _python_files(PACKAGE)
        if p.name != "__init__.py" and f"`{p.relative_to(PACKAGE)}`" not in module_map
    ]
    assert not missing, f"docs/design.md's module map does not name: {missing}"


def _notes_in_code() -> dict[str, str]:
    notes = {}
    for path in _python_files(PACKAGE):
        # A note name may be wrapped over two comment lines: drop the comment markers.
        text = re.sub(r"\n\s*#\s*", " ", path.read_text())
        for match in re.finditer(r"\[Note: ([^\]]+)\]", text):
            notes.setdefault(" ".join(match.group(1).split()), str(path.relative_to(PACKAGE)))
    return notes


def test_design_note_index_names_every_note_in_the_code() -> None:
    index = _design_section("Design notes")
    # One note per row: note names may hold commas ("two streams, four conditions").
    indexed = {row.strip() for row in re.findall(r"^\| ([^|]+) \|", index, flags=re.MULTILINE)}
    missing = {name: where for name, where in _notes_in_code().items() if name not in indexed}
    assert not missing, f"notes missing from docs/design.md's index (name: first file): {missing}"


@pytest.mark.parametrize("layer", CORE_LAYERS[1:])
def test_each_layer_is_a_package(layer: str) -> None:
    assert (CORE / layer / "__init__.py").is_file()


# -- import circles ---------------------------------------------------------------------------

# Circles allowed to exist (none since issue 34): each listed one must still exist, so the
# list can only shrink.
_KNOWN_CIRCLES: set[frozenset[str]] = set()


def _import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (every import: lazy and type-only too)."""

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        targets = {resolve(name) for _, name in _imported_modules(path, module=module)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_circle_beyond_the_known_ones() -> None:
    files = {_module_name(p): p for p in _python_files(PACKAGE)}
    prefix = "lightning_yafsdp."
    found = _circles(_import_graph(files))
    circles = {frozenset(m.removeprefix(prefix) for m in circle) for circle in found}
    new = [sorted(c) for c in circles - _KNOWN_CIRCLES]
    assert not new, f"import circles (a module reaching itself through its imports): {new}"
    gone = [sorted(c) for c in _KNOWN_CIRCLES - circles]
    assert not gone, f"these circles are gone: remove them from _KNOWN_CIRCLES: {gone}"


def test_the_circle_finder_sees_lazy_and_type_only_imports(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("def f():\n    from pkg import b\n")
    (tmp_path / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import C\n"
    )
    (tmp_path / "c.py").write_text("import pkg.a\n")
    (tmp_path / "d.py").write_text("import pkg.a\n")
    files = {f"pkg.{name}": tmp_path / f"{name}.py" for name in "abcd"}
    assert _circles(_import_graph(files)) == [frozenset({"pkg.a", "pkg.b", "pkg.c"})]



# -- the step context ([Note: step context]) -----------------------------------------------

RUNTIME = CORE / "runtime"
ENGINE_MODULE = "lightning_yafsdp.core.runtime.engine"
ENGINE_MAX_METHODS = 30


def test_no_runtime_group_imports_the_engine() -> None:
    # The groups get the step context; the engine is above them (type-only imports count).
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in _python_files(RUNTIME)
        if path.stem != "engine"
        for line, name in _imported_modules(path)
        if name == ENGINE_MODULE or name.startswith(ENGINE_MODULE + ".")
    ]
    assert not offenders, "runtime modules importing the engine:\n" + "\n".join(offenders)


def test_the_engine_has_at_most_30_methods() -> None:
    tree = ast.parse((RUNTIME / "engine.py").read_text())
    (engine,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "YaFSDPEngine"]
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    methods = [n.name for n in engine.body if isinstance(n, functions)]
    assert len(methods) <= ENGINE_MAX_METHODS, (len(methods), methods)
