"""The house rules, checked: one installed namespace, every package listed, no import cycles, a
scheduler that never imports MLX, and rooms of a readable size."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = ("configs", "scheduler", "scripts", "server", "workloads")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    """batchsim module name -> file, for every module the package installs."""
    found = {}
    for top in TOP:
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(["batchsim", *parts])] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The batchsim modules a file imports anywhere (module level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module in modules:
            for a in node.names:  # `from pkg import module` imports the module
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in modules else node.module)
    return out


def test_only_the_batchsim_namespace_is_installed(tmp_path):
    """Outside the checkout, the generic folder names are not importable; batchsim.* is."""
    code = ("import importlib.util as u; import batchsim.server.engine.engine; "
            f"print([n for n in {TOP!r} if u.find_spec(n) is not None])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path,
                          capture_output=True, check=False,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_pyproject_lists_every_package():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {m for m, p in _modules().items() if p.name == "__init__.py"}
    assert set(config["packages"]) == packages
    assert config["package-dir"] == {"batchsim": "."}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every back edge of a depth-first walk, as the path it closes."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_import_cycles_between_modules():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_cycles_between_folders():
    """Rooms depend one way: e.g. server/executors uses server/perf, never the reverse."""
    modules = _modules()

    def folder(m: str) -> str:
        return m if modules[m].name == "__init__.py" else m.rpartition(".")[0]

    graph: dict[str, set[str]] = {folder(m): set() for m in modules}
    for m, path in modules.items():
        graph[folder(m)] |= {folder(d) for d in _imports(path, modules)} - {folder(m)}
    cycles = _cycles(graph)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_command_imports_another_command():
    """A command's module (one `batchsim` subcommand) is cli.py's alone: what commands share lives
    in scripts/common.py, run_args.py, run_view.py, or in the server's rooms."""
    from batchsim.scripts.cli import COMMANDS

    commands = {module for _, module, _ in COMMANDS}
    modules = _modules()
    found = {m: sorted(_imports(p, modules) & (commands - {m})) for m, p in modules.items()
             if m != "batchsim.scripts.cli"}
    assert {m: c for m, c in found.items() if c} == {}


def _test_modules_imported(path: Path) -> list[str]:
    """The tests.test_* modules a file under tests/ imports (absolute or relative, anywhere)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = f"tests.{node.module or ''}".rstrip(".") if node.level else node.module or ""
            out += [module] + [f"{module}.{a.name}" for a in node.names]
    return sorted({m for m in out if m.startswith("tests.test_") and m.count(".") == 1})


def test_no_test_module_imports_another():
    """What tests share lives in tests/'s helper modules (drivers.py, cli_calls.py, sim_records.py,
    ...), never in a test module: importing one ran its module-level code for a file that wanted
    one helper, tied the two files' names together, and re-exported fixtures under noqa."""
    found = {p.name: _test_modules_imported(p) for p in sorted((ROOT / "tests").glob("*.py"))}
    assert {name: mods for name, mods in found.items() if mods} == {}


def test_scheduler_is_pure_python():
    """Policy never imports MLX or the executors: the same scheduler runs real and simulated."""
    for path in (ROOT / "scheduler").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(("mlx", "numpy", "batchsim.server")), (path.name, name)


@pytest.mark.parametrize("top", [*TOP, "tests"])
def test_rooms_stay_small(top):
    """Modules of at most MAX_MODULE_LINES, tests' included; functions of at most
    MAX_FUNCTION_LINES in the package (a test may spell out a long scenario)."""
    for path in (ROOT / top).rglob("*.py"):
        source = path.read_text()
        rel = path.relative_to(ROOT)
        assert source.count("\n") <= MAX_MODULE_LINES, f"{rel}: {source.count(chr(10))} lines"
        if top == "tests":
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                assert n <= MAX_FUNCTION_LINES, f"{rel}:{node.name} is {n} lines"
