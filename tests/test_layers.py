"""The layers, read from the source's import statements (ast; nothing is imported):

- gdnkit's core (gdnkit/, integrations aside) imports no backend at module level; inside a function only the
  shared Triton pieces (gdnkit.backends.triton_shared: the prologue's l2norm passes) or, in the command line
  (gdnkit/__main__.py, `gdnkit warm`), tilelang_sm90's precompile entry point. dispatch/ loads backends by name
  (registry.BACKEND_MODULES), never by an import statement.
- A backend imports no other backend; all of them may import gdnkit's core, dispatch and triton_shared, which
  imports no backend.
- No module imports another module's private (`_name`) names.
- The benchmarks reach gdnkit through its public API (gdnkit, gdnkit.distributed, gdnkit.integrations), never a
  backend, and do not read kernel source to rewrite it.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
# where each installed package's source lives (pyproject.toml's package-dir)
SOURCE_DIRS = {"gdnkit": "gdnkit", "gdnkit.dispatch": "dispatch", "gdnkit.backends": "backends",
               "gdnkit.benchmarks": "benchmarks"}
BACKENDS = ("reference", "triton_generic", "tilelang_sm90")
SHARED = "gdnkit.backends.triton_shared"
CORE_SEAMS = {  # core module -> the backend modules it may import inside a function
    "gdnkit.__main__": ("gdnkit.backends.tilelang_sm90.precompile",),
}
PUBLIC_FOR_BENCHMARKS = ("gdnkit", "gdnkit.distributed", "gdnkit.integrations")


class Import(NamedTuple):
    module: str           # the importing module
    target: str           # the module imported from (absolute)
    names: tuple          # the names imported from it (empty for `import x`)
    top_level: bool       # at module level (not inside a function)
    line: int


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    for package, folder in sorted(SOURCE_DIRS.items(), key=lambda kv: -len(kv[1])):
        if rel.parts[0] == folder:
            parts = [*package.split("."), *rel.with_suffix("").parts[1:]]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise ValueError(path)


def source_path(module: str) -> Path | None:
    """The folder or file of an installed module name in this tree, None for anything else."""
    for package, folder in sorted(SOURCE_DIRS.items(), key=lambda kv: -len(kv[0])):
        if within(module, package):
            base = ROOT / folder / Path(*module[len(package):].lstrip(".").split(".") if module != package else ())
            return base
    return None


def is_module(module: str) -> bool:
    base = source_path(module)
    return base is not None and (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file())


def imports_of(module: str, source: str, is_package: bool = False) -> list[Import]:
    """Every import statement of `module`'s source, relative ones resolved."""
    found = []
    package = module if is_package else module.rpartition(".")[0]

    def visit(node, top_level):
        for child in ast.iter_child_nodes(node):
            inside = top_level and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend(Import(module, a.name, (), top_level, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package.split(".")
                if child.level:
                    base = base[:len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module
                names = tuple(a.name for a in child.names)
                # `from package import module` imports a module; `from module import name`, names of it
                modules = [n for n in names if child.module is None or is_module(f"{target}.{n}")]
                found.extend(Import(module, f"{target}.{n}", (), top_level, child.lineno) for n in modules)
                rest = tuple(n for n in names if n not in modules)
                if rest:
                    found.append(Import(module, target, rest, top_level, child.lineno))
            visit(child, inside)

    visit(ast.parse(source), True)
    return found


def all_imports() -> list[Import]:
    found = []
    for folder in SOURCE_DIRS.values():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "results" in path.relative_to(ROOT).parts:
                continue
            found += imports_of(module_name(path), path.read_text(), path.name == "__init__.py")
    return found


def backend_of(module: str) -> str | None:
    """The backend (or "triton_shared") a module of gdnkit.backends belongs to."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["gdnkit", "backends"] and len(parts) > 2 else None


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(imports: list[Import]) -> list[str]:
    out = []
    for imp in imports:
        where = f"{imp.module}:{imp.line} imports {imp.target}"
        mine, theirs = backend_of(imp.module), backend_of(imp.target)
        core = within(imp.module, "gdnkit") and not any(
            within(imp.module, p) for p in ("gdnkit.integrations", "gdnkit.dispatch", "gdnkit.backends",
                                            "gdnkit.benchmarks"))
        if core and theirs is not None:
            seam = imp.target in CORE_SEAMS.get(imp.module, ())
            if imp.top_level:
                out.append(f"{where}: gdnkit's core imports a backend at module level")
            elif not (within(imp.target, SHARED) or seam):
                out.append(f"{where}: gdnkit's core imports a backend")
        if within(imp.module, "gdnkit.dispatch") and theirs is not None:
            out.append(f"{where}: dispatch imports a backend (it loads them by name)")
        if mine is not None and theirs is not None and mine != theirs and theirs != "triton_shared":
            out.append(f"{where}: a backend imports another backend")
        if mine == "triton_shared" and theirs not in (None, "triton_shared"):
            out.append(f"{where}: triton_shared imports a backend")
        if within(imp.module, "gdnkit.benchmarks") and within(imp.target, "gdnkit") and not any(
                within(imp.target, p) if p != "gdnkit" else imp.target == "gdnkit"
                for p in (*PUBLIC_FOR_BENCHMARKS, "gdnkit.benchmarks")):
            out.append(f"{where}: a benchmark reaches past the public API")
        if imp.target != imp.module:
            private = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
            if private:
                out.append(f"{where}: private names {private}")
    return out


def test_the_tree_keeps_its_layers():
    imports = all_imports()
    assert len(imports) > 200   # the walk found the source
    assert violations(imports) == []


def test_the_checker_flags_each_kind_of_crossing():
    cases = {
        ("gdnkit.api", "from gdnkit.backends.triton_shared import l2norm"): "module level",
        ("gdnkit.api", "def f():\n    from gdnkit.backends.triton_generic import chunked"): "core imports a backend",
        ("gdnkit.dispatch.select", "from gdnkit.backends import reference"): "dispatch imports",
        ("gdnkit.backends.tilelang_sm90.forward", "from ..triton_generic import chunked"): "another backend",
        ("gdnkit.backends.tilelang_sm90.forward",
         "def f():\n    from gdnkit.backends.triton_generic.state_pass import state_pass"): "another backend",
        ("gdnkit.backends.triton_shared.l2norm", "from ..reference import recurrent_gdn"): "triton_shared imports",
        ("gdnkit.backends.tilelang_sm90.backward", "from .forward import _helper"): "private names",
        ("gdnkit.benchmarks.runner", "from gdnkit.backends.tilelang_sm90 import forward"): "past the public API",
    }
    for (module, source), message in cases.items():
        found = violations(imports_of(module, source))
        assert any(message in v for v in found), (module, source, found)


@pytest.mark.parametrize("module, source", [
    ("gdnkit.prologue", "def f():\n    from gdnkit.backends.triton_shared.l2norm import l2norm_forward"),
    ("gdnkit.__main__", "def f():\n    from gdnkit.backends.tilelang_sm90 import precompile"),
    ("gdnkit.backends.tilelang_sm90.context_parallel", "from ..triton_shared.segments import segment_scan"),
    ("gdnkit.backends.triton_generic.chunked", "from . import output\nfrom .output import output"),
    ("gdnkit.benchmarks.runner",
     "import gdnkit\nfrom gdnkit.integrations import transformers\nfrom .grids import Grid"),
], ids=["prologue-shared-l2norm", "cli-precompile", "backend-shared-segments", "own-package", "benchmark-public-api"])
def test_the_checker_allows_the_documented_seams(module, source):
    assert violations(imports_of(module, source)) == []


def test_relative_imports_resolve_from_their_package():
    got = {i.target for i in imports_of("gdnkit.backends.triton_generic.chunked",
                                        "from ..triton_shared.sizes import cdiv\nfrom . import output")}
    assert got == {"gdnkit.backends.triton_shared.sizes", "gdnkit.backends.triton_generic.output"}
    got = {i.target for i in imports_of("gdnkit.backends.reference", "from .chunked import chunked_gdn", True)}
    assert got == {"gdnkit.backends.reference.chunked"}


def test_benchmarks_do_not_rewrite_kernel_source():
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text())
        reads = [n.lineno for n in ast.walk(tree)
                 if isinstance(n, ast.Attribute) and n.attr in ("getsource", "getsourcelines", "src")
                 or isinstance(n, ast.Name) and n.id in ("exec", "eval")]
        assert reads == [], f"{path.name} reads or runs source text at lines {reads}"
