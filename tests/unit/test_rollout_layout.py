"""The rollout package as docs/architecture.md draws it: one folder per engine and per backend, each
holding its plug-in, and no circle of imports between its modules (imports inside functions and
under TYPE_CHECKING count: a cycle dodged by a late import is still a cycle)."""

import ast
from pathlib import Path

from test_architecture import cycle  # the same search for a cycle, over rollout's modules

from tether import registry

SRC = Path(__file__).resolve().parents[2] / "src"
ROLLOUT = SRC / "tether" / "rollout"


def module_of(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_of(p): p for p in ROLLOUT.rglob("*.py")}


def imports(path: Path, known: set[str]) -> set[str]:
    """The rollout modules ``path`` imports: ``from a.b import c`` is ``a.b.c`` when that is a module,
    else ``a.b``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in known else node.module)
        elif isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
    return out & known


def test_no_circle_of_imports_inside_rollout():
    known = modules()
    graph = {name: imports(path, set(known)) - {name} for name, path in known.items()}
    found = cycle(graph)
    assert found is None, f"import cycle in rollout/: {' → '.join(found)}"


def test_the_cycle_check_sees_a_late_import():
    assert cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_each_built_in_engine_and_backend_is_a_folder_holding_its_plugin():
    for reg, folder in ((registry.engines, "engines"), (registry.backends, "backends")):
        for name in reg.builtins:
            plugin = reg.get(name)
            module = type(plugin).__module__
            assert module == f"tether.rollout.{folder}.{name}", (name, module)
            assert (ROLLOUT / folder / name / "__init__.py").is_file()
            if plugin.section is not None:  # its section is its own, beside it
                assert plugin.section[1].__module__.startswith(f"tether.rollout.{folder}.{name}")
