"""The package's imports: no cycles, the tools above the runtime, and no effect on Lightning from importing."""

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# callbacks/ and kernels/ ship inside the package (pyproject.toml's package-dir).
PACKAGE_DIRS = {
    "uma_lightning": REPO / "uma_lightning",
    "uma_lightning.callbacks": REPO / "callbacks",
    "uma_lightning.kernels": REPO / "kernels",
}


def modules_of(package_dirs: dict[str, Path]) -> dict[str, tuple[Path, bool]]:
    """``{module name: (source file, is a package)}``; a directory mapped explicitly wins over the same
    name found by walking its parent."""
    found = {}
    for package, directory in sorted(package_dirs.items()):
        for source in sorted(directory.rglob("*.py")):
            parts = source.relative_to(directory).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join((package, *(parts[:-1] if is_package else parts)))
            if not any(
                name == other or name.startswith(other + ".")
                for other in package_dirs
                if other != package and other.startswith(package + ".")
            ):
                found[name] = (source, is_package)
    return found


def import_graph(package_dirs: dict[str, Path]) -> dict[str, set[str]]:
    """Every module's imports of modules of the same package, wherever they are in the file (a lazy
    import inside a function makes a cycle as surely as one at the top). ``from pkg import sub`` is an
    edge to the submodule; ``from pkg import name`` one to the package's ``__init__``."""
    modules = modules_of(package_dirs)
    graph = {}
    for name, (source, is_package) in modules.items():
        here = name if is_package else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = here.rsplit(".", node.level - 1)[0] if node.level else ""
                origin = ".".join(part for part in (base, node.module) if part)
                for alias in node.names:
                    targets.add(f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules else origin)
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected group of modules, found by Tarjan's algorithm."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group, member = set(), None
            while member != module:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
            if len(group) > 1:
                groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [_cycle_within(group, graph) for group in groups]


def _cycle_within(group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph[module] & group):
                if target == start:
                    return paths[module] + [start]
                if target not in paths:
                    paths[target] = paths[module] + [target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def describe(cycles: list[list[str]]) -> str:
    return "import cycles: " + "; ".join(" -> ".join(cycle) for cycle in cycles)


def test_the_package_has_no_import_cycles():
    graph = import_graph(PACKAGE_DIRS)
    assert {"uma_lightning.callbacks.checkpointing", "uma_lightning.kernels.attention", "uma_lightning.cli"} <= set(
        graph
    )
    cycles = import_cycles(graph)
    assert not cycles, describe(cycles)


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_cycle_check_names_a_cycle_and_is_quiet_without_one(tmp_path):
    acyclic = {
        "pkg/__init__.py": "from pkg.a import f\n",  # a package re-exporting its modules is no cycle
        "pkg/a.py": "import os\nfrom pkg import b\nfrom .sub import c\n\ndef f():\n    pass\n",
        "pkg/b.py": "import pkg.sub.c\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "def g():\n    from pkg.plugins import more\n",
        "extra/__init__.py": "",
        "extra/more.py": "import os\n",
    }
    # extra/ ships as pkg.plugins, as callbacks/ ships as uma_lightning.callbacks.
    quiet = write_tree(tmp_path / "acyclic", acyclic)
    graph = import_graph({"pkg": quiet / "pkg", "pkg.plugins": quiet / "extra"})
    assert graph["pkg.a"] == {"pkg.b", "pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.plugins.more"}
    assert import_cycles(graph) == []
    # Closed by a relative import in the shipped directory, and run only lazily, inside a function.
    cyclic = write_tree(tmp_path / "cyclic", {**acyclic, "extra/more.py": "from ..a import f\n"})
    cycles = import_cycles(import_graph({"pkg": cyclic / "pkg", "pkg.plugins": cyclic / "extra"}))
    assert cycles == [["pkg.a", "pkg.sub.c", "pkg.plugins.more", "pkg.a"]], cycles
    assert describe(cycles) == "import cycles: pkg.a -> pkg.sub.c -> pkg.plugins.more -> pkg.a"


def test_only_the_tools_import_the_command_line():
    """``uma_lightning.cli`` is the top of the runtime: the tools build on it, nothing below imports it;
    above it is only ``uma_lightning.command``, the ``uma`` command that hands a subcommand over."""
    graph = import_graph(PACKAGE_DIRS)
    importers = sorted(name for name, targets in graph.items() if "uma_lightning.cli" in targets)
    assert "uma_lightning.command" in importers, importers
    assert all(name.startswith("uma_lightning.tools.") or name == "uma_lightning.command" for name in importers)
    top = ("uma_lightning.cli", "uma_lightning.command")
    runtime = {name for name in graph if not name.startswith("uma_lightning.tools") and name not in top}
    reaching = sorted(name for name in runtime if any(t.startswith("uma_lightning.tools") for t in graph[name]))
    assert not reaching, f"runtime modules that import a tool: {reaching}"


REGISTRIES = """
import json, sys
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.accelerators import AcceleratorRegistry

def snapshot():
    return {
        "strategies": {name: repr(entry) for name, entry in StrategyRegistry.items()},
        "accelerators": sorted(AcceleratorRegistry),
    }

before = snapshot()
import importlib
for name in sys.argv[1:]:
    importlib.import_module(name)
after = snapshot()
print(json.dumps({"before": before, "after": after}))
"""


def _registries_after_importing(modules: list[str]) -> tuple[dict, dict]:
    done = subprocess.run(
        [sys.executable, "-c", REGISTRIES, *modules], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return found["before"], found["after"]


def test_importing_every_module_leaves_lightnings_registries_as_they_were():
    # The tools' own modules and scripts (a parity worker, the planner) included; gpu-only kernels import lazily.
    modules = sorted(modules_of(PACKAGE_DIRS))
    assert len(modules) > 100 and "uma_lightning.parallel.strategy" in modules and "uma_lightning.data" in modules
    before, after = _registries_after_importing(modules)
    assert after == before, {
        name: (before["strategies"].get(name), after["strategies"].get(name))
        for name in set(before["strategies"]) | set(after["strategies"])
        if before["strategies"].get(name) != after["strategies"].get(name)
    }


def test_the_registry_check_sees_a_registration():
    """The comparison is not blind: registering our strategies, as the ``uma`` command does, changes both names."""
    before, after = _registries_after_importing(["uma_lightning.data"])
    assert after == before
    script = REGISTRIES.replace(
        "after = snapshot()",
        "from uma_lightning.parallel import register_strategies\nregister_strategies()\nafter = snapshot()",
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    changed = {
        n
        for n in found["after"]["strategies"]
        if found["after"]["strategies"][n] != found["before"]["strategies"].get(n)
    }
    assert {"ddp", "fsdp", "fsdp_tp", "pp"} <= changed, changed
