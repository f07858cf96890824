"""The layering docs/architecture.md draws, checked on the source: no import cycle between Tether's
packages (imports inside functions count), ``runtime`` never imports ``cli``, and only the
families and the one composition root compare the names a recipe chooses plug-ins by."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "tether"
CHOSEN_BY = {"family", "engine", "backend"}  # model.family, rollout.engine, rollout.backend
MAY_COMPARE = ("families/", "runtime/assemble.py")


def unit_of(module: str) -> str | None:
    """``tether.<unit>.…`` → ``<unit>``: a subpackage or a top-level module of Tether."""
    parts = module.split(".")
    if parts[0] != "tether" or len(parts) < 2:
        return None
    return parts[1]


def imported_units(path: Path) -> set[str]:
    """The units a source file imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {unit_of(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "tether":  # from tether import registry
                out |= {alias.name for alias in node.names if (SRC / f"{alias.name}.py").exists()
                        or (SRC / alias.name).is_dir()}
            else:
                out.add(unit_of(node.module))
    return out - {None}


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        unit = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name != "__init__.py" else None
        if unit is None:
            continue
        graph.setdefault(unit, set()).update(imported_units(path) - {unit})
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the path around it, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_packages_import_each_other_without_a_cycle():
    graph = import_graph()
    assert {"control", "loop", "config", "rollout", "train", "families", "runtime", "cli"} <= set(graph)
    found = cycle(graph)
    assert found is None, f"import cycle: {' → '.join(found)}"


def test_the_cycle_check_sees_imports_inside_functions(tmp_path):
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from tether.runtime import run\n    import tether.cli.main\n"
                      "from tether import registry\n")
    assert imported_units(source) == {"runtime", "cli", "registry"}


def test_runtime_does_not_import_cli_and_the_loop_imports_no_plugin():
    graph = import_graph()
    assert "cli" not in graph["runtime"]
    for core in ("control", "loop", "vocabulary", "registry"):
        assert not graph[core] & {"families", "rollout", "train", "runtime", "cli"}, (core, graph[core])


def literal_choices(path: Path) -> list[str]:
    """``line: source`` of each comparison of a ``.family``, ``.engine`` or ``.backend`` with a
    string literal (or a collection of them)."""
    def is_choice(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr in CHOSEN_BY

    def is_literal(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str)
        return isinstance(node, ast.Tuple | ast.List | ast.Set) and all(map(is_literal, node.elts))

    text = path.read_text()
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(map(is_choice, sides)) and any(map(is_literal, sides)):
                found.append(f"{node.lineno}: {ast.get_source_segment(text, node)}")
    return found


def test_only_the_families_and_the_composition_root_compare_chosen_names():
    offenders = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(MAY_COMPARE):
            continue
        if found := literal_choices(path):
            offenders[rel] = found
    assert offenders == {}


def test_the_literal_check_finds_what_it_looks_for(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('if cfg.model.family == "flow": pass\nif spec.engine in ("vllm",): pass\n'
                      'if task.family != family.name: pass\nif backend == "nccl": pass\n')
    assert literal_choices(source) == ['1: cfg.model.family == "flow"', '2: spec.engine in ("vllm",)']


MODE_WORDS = {"drain", "keep", "recompute", "abort", "cannot", "keep_cache", "recompute_cache", "restart"}
MAY_NAME_MODES = ("control/inflight.py",)  # the one module that says what an in-flight mode does


def literal_modes(path: Path) -> list[str]:
    """``line: source`` of each place that tells in-flight modes apart by name (or by ``on_switch``
    value) as a string literal: a comparison with one or a collection of them
    (``async.inflight_update == "keep"``), a ``match`` case, or a dict keyed by them (a table of
    what each mode does, kept outside the policy)."""
    def is_mode_literal(node: ast.AST | None) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in MODE_WORDS
        return (isinstance(node, ast.Tuple | ast.List | ast.Set) and bool(node.elts)
                and all(map(is_mode_literal, node.elts)))

    def names_modes(node: ast.AST) -> bool:
        if isinstance(node, ast.Compare):
            return any(map(is_mode_literal, [node.left, *node.comparators]))
        if isinstance(node, ast.MatchValue):
            return is_mode_literal(node.value)
        return isinstance(node, ast.Dict) and any(map(is_mode_literal, node.keys))

    text = path.read_text()
    found = sorted((n for n in ast.walk(ast.parse(text)) if names_modes(n)),
                   key=lambda n: (n.lineno, n.col_offset))
    return [f"{node.lineno}: {ast.get_source_segment(text, node)}" for node in found]


def test_only_the_inflight_policy_compares_mode_names():
    """Every other module reads ``tether.control.inflight``'s declared attributes."""
    offenders = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        if rel in MAY_NAME_MODES:
            continue
        if found := literal_modes(path):
            offenders[rel] = found
    assert offenders == {}


def test_the_mode_check_finds_what_it_looks_for(tmp_path):
    source = tmp_path / "m.py"
    source.write_text('if cfg.async_.inflight_update != "drain": pass\n'
                      'if mode in ("recompute", "abort"): pass\n'
                      'if m.on_switch == "keep_cache": pass\nif reason == "eval": pass\nemit("drain")\n'
                      'match mode:\n    case "abort": pass\n    case _: pass\n'
                      'cost = {"recompute": 1.0, "other": 0.0}\nrows = {"eval": 1}\n')
    assert literal_modes(source) == ['1: cfg.async_.inflight_update != "drain"',
                                     '2: mode in ("recompute", "abort")', '3: m.on_switch == "keep_cache"',
                                     '7: "abort"', '9: {"recompute": 1.0, "other": 0.0}']


def test_every_test_module_has_a_name_of_its_own():
    """pytest runs tests/ without packages (no __init__.py), so two test modules of one basename in
    different folders stop the collection of the whole suite ("import file mismatch")."""
    from collections import Counter
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    names = Counter(p.name for p in tests.rglob("test_*.py"))
    assert not [name for name, n in names.items() if n > 1], "rename one of each pair"
