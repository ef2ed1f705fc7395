"""The shape of the code: imports go downward (docs/architecture.md, "Layers"), no cycles, no private reach-ins,
and the registries agree with what reads them."""
from __future__ import annotations

import ast
import enum
import functools
import inspect
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pilotrun"

# Top layer first, as in docs/architecture.md. A module's layer is that of its first path part under pilotrun/.
LAYERS: list[set[str]] = [
    {"__main__"},
    {"cli"},
    {"ui", "report", "deploy"},
    {"integrations"},
    {"pilot", "campaign", "estimate", "variants"},
    {"gates"},
    {"workers"},
    {"drivers"},
    {"program", "api"},
    {"strategies"},
    {"train", "checkpoint", "models", "data"},
    {"ledger", "measure", "config", "lock", "devices", "distributed", "batching", "humanize", "interrupt", "procs",
     "keeper", "safefile"},
    {"backends", "errors"},
]
# Siblings that may import each other inside one layer (everything else in a layer is independent).
# program/: the handle measures stages with api's code. procs: starts the keeper script by its path.
SIBLINGS = {("lock", "config"), ("program", "api"), ("procs", "keeper"), ("safefile", "humanize")}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (annotations only: no runtime edge)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def _imports(runtime_only: bool = False) -> list[tuple[str, str, str]]:
    """(importing module, imported module, imported name or '') for every pilotrun import, lazy ones included."""
    edges = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        skip = _type_only(tree) if runtime_only else set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                target = _resolve(module, path.name == "__init__.py", node)
                if not target.startswith("pilotrun"):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    edges.append((module, sub if sub in MODULES else target, "" if sub in MODULES else alias.name))
            elif isinstance(node, ast.Import):
                edges += [(module, a.name, "") for a in node.names if a.name.startswith("pilotrun")]
    return edges


EDGES = _imports()


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(module: str) -> int:
    part = _part(module)
    for i, layer in enumerate(LAYERS):
        if part in layer:
            return i
    raise AssertionError(f"{module} is in no layer: add {part!r} to LAYERS and to docs/architecture.md")


def test_every_module_has_a_layer():
    for module in MODULES:
        if module != "pilotrun":
            _layer(module)


def test_imports_go_downward_only():
    upward, sideways = [], []
    for src, dst, _ in EDGES:
        if src == "pilotrun" or dst == "pilotrun":
            continue
        a, b = _part(src), _part(dst)
        if a == b:
            continue
        la, lb = _layer(src), _layer(dst)
        if lb < la:
            upward.append(f"{src} -> {dst}")
        elif la == lb and (a, b) not in SIBLINGS:
            sideways.append(f"{src} -> {dst}")
    assert not upward, "imports from a higher layer: " + "; ".join(sorted(upward))
    assert not sideways, "imports between independent siblings of one layer: " + "; ".join(sorted(sideways))


def test_no_import_cycles_between_modules():
    graph: dict[str, set[str]] = {}
    for src, dst, _ in _imports(runtime_only=True):
        if src != dst and dst in MODULES and not MODULES[dst].name == "__init__.py":
            graph.setdefault(src, set()).add(dst)
    # Tarjan's strongly connected components: any of size > 1 is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_names_imported_across_modules():
    found = [f"{src} imports {dst}.{name}" for src, dst, name in EDGES
             if name.startswith("_") and not name.startswith("__") and dst != src]
    assert not found, "; ".join(found)


def test_the_spec_and_the_registry_share_one_strategy_vocabulary():
    import types
    import typing

    from pilotrun import strategies
    from pilotrun.config import strategy_names
    from pilotrun.config.schema import SpecError, build
    from pilotrun.config.sections import DistributedSpec
    from pilotrun.config.spec import Spec

    # The spec validates against config's mirror of the names; the registry refuses to import unless it is exact.
    declared = typing.get_args(typing.get_type_hints(DistributedSpec)["strategy"])
    assert list(declared) == list(strategy_names.NAMES) == strategies.names()
    assert strategies.vocabulary_problems(strategies.STRATEGIES) == []
    grown = {**strategies.STRATEGIES, "tensor": strategies.get("ddp")}
    assert strategies.vocabulary_problems(grown) == [
        "the spec's choices ['single', 'ddp', 'fsdp'] are not the registry's ['single', 'ddp', 'fsdp', 'tensor']"]
    stale = types.SimpleNamespace(NAMES=strategy_names.NAMES, DEFAULT="ddp", ALIASES={"none": "solo"},
                                  OFFLOADING=strategy_names.OFFLOADING)
    assert strategies.vocabulary_problems(strategies.STRATEGIES, stale) == [
        "the spec's default 'ddp' is not the one-process strategy ['single']",
        "the alias 'none' names 'solo', which is not registered"]
    minimal = {"name": "v", "model": {"factory": "x:y"}, "data": {"factory": "x:y"},
               "train": {"micro_batch_size": 1, "grad_accum_steps": 1, "updates": 2, "optimizer": {"name": "sgd", "lr": 0.1}}}
    with pytest.raises(SpecError) as info:
        build(Spec, {**minimal, "distributed": {"strategy": "fsdp2"}})
    assert info.value.problems == [("distributed.strategy", "expected one of 'single', 'ddp', 'fsdp', got 'fsdp2' "
                                                            "(str) (did you mean 'fsdp'?)")]
    assert build(Spec, minimal).distributed.strategy == strategies.one_process().name
    assert build(Spec, {**minimal, "distributed": {"strategy": "none"}}).distributed.strategy == "single"
    with pytest.raises(strategies.UnknownStrategy, match="choose one of: single .*, ddp .*, fsdp"):
        strategies.get("tensor")
    assert strategies.get("none") is strategies.get("single")  # specs written before the rename


def test_the_registry_answers_what_callers_would_otherwise_ask_by_name():
    from pilotrun import strategies

    assert [n for n in strategies.names() if strategies.get(n).shards] == ["fsdp"]
    assert strategies.sharding() is strategies.get("fsdp")
    assert strategies.one_process() is strategies.get("single") is strategies.for_processes("ddp", 1)


# A strategy's name as a value outside pilotrun/strategies/ is a comparison (`== "fsdp"`, `in ("single", ...)`) or a
# choice (`"fsdp" if shard else name`, `{"distributed.strategy": "fsdp"}`, `advise(..., "single")`) made by name:
# ask the object (`get(name).shards`, `.multi_process`) or the registry (`sharding()`, `one_process()`) instead.
# Docstrings (examples) are text. Allowed, with why:
NAME_VALUES_ALLOWED: dict[str, set[str] | None] = {
    "config/strategy_names.py": None,  # the mirror of the registry's names the spec validates against (all of it)
    "distributed.py": {"strategy"},   # DistEnv.strategy's default: layer 9 records the name, cannot ask the registry
}


def _docstrings(tree: ast.Module) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def strategy_names_used(source: str, names: set[str], allowed_fields: set[str] = frozenset()) -> list[int]:
    """Lines where ``source`` uses one of ``names`` as a string value (docstrings and the defaults of the
    annotated fields ``allowed_fields`` excepted)."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) in allowed_fields and node.value:
            skip.add(id(node.value))
    return sorted(node.lineno for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in names and id(node) not in skip)


def test_the_check_for_strategy_names_finds_comparisons_and_choices():
    names = {"single", "fsdp"}
    source = ('"""fsdp"""\nif s == "fsdp":\n    pass\nx = "fsdp" if a else s\nok = s in ("single",)\n'
              'd = {"distributed.strategy": "fsdp"}\nf(s, "single")\nclass E:\n    strategy: str = "single"\n')
    assert strategy_names_used(source, names) == [2, 4, 5, 6, 7, 9]
    assert strategy_names_used(source, names, {"strategy"}) == [2, 4, 5, 6, 7]


def test_no_module_outside_strategies_chooses_or_compares_a_strategy_by_name():
    from pilotrun import strategies

    names = set(strategies.names())
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("strategies/") or (rel in NAME_VALUES_ALLOWED and NAME_VALUES_ALLOWED[rel] is None):
            continue
        lines = strategy_names_used(path.read_text(), names, NAME_VALUES_ALLOWED.get(rel) or set())
        found += [f"pilotrun/{rel}:{line}" for line in lines]
    assert not found, ("a strategy named outside pilotrun/strategies/ (ask the object or the registry: "
                       f"get(name).shards, one_process(), sharding()): {', '.join(found)}")


# Where a spec's sections are read as what they are: the spec's own modules (config/), the campaign file's parser,
# and the lock, which records each section the spec has. The connector is Spec.kind (decided once) and the tables
# keyed by it (drivers/build.py: DRIVERS, campaign/kinds.py: KINDS); everywhere else asks the object chosen
# (driver_class(spec).in_process, kinds.of(spec).over_nodes), never which kind a spec is.
KIND_DECIDED_IN = ("config/", "campaign/spec.py", "lock.py")
CONNECTOR = ("config/spec.py", "drivers/build.py", "campaign/kinds.py")


def kind_tests(source: str) -> list[int]:
    """Lines that branch on a spec's kind: ``x.program is None`` or ``x.train is not None`` (deciding it again from
    the sections), or a comparison with ``JobKind.<KIND>``; an ``assert`` narrowing a type after the decision is not
    one."""
    tree = ast.parse(source)
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare) or len(node.ops) != 1:
            continue
        left, right = node.left, node.comparators[0]
        if isinstance(left, ast.Attribute) and left.attr in ("program", "train") and \
                isinstance(node.ops[0], (ast.Is, ast.IsNot)) and isinstance(right, ast.Constant) and right.value is None:
            out.add(node.lineno)
        if any(isinstance(side, ast.Attribute) and isinstance(side.value, ast.Name) and side.value.id == "JobKind"
               for side in (left, right)):
            out.add(node.lineno)
    asserted = {n.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)
                for n in ast.walk(node) if hasattr(n, "lineno")}
    return sorted(out - asserted)


def test_the_kind_check_finds_decisions_and_leaves_asserts():
    source = ("if spec.program is not None:\n    pass\nx = a if c.program is None else b\n"
              "assert spec.program is not None\nreturn s.train is None\ny = s.program.words\n"
              "if spec.kind is JobKind.PROGRAM:\n    pass\nz = JobKind.LOOP != k\nDRIVERS = {JobKind.LOOP: 1}\n")
    assert kind_tests(source) == [1, 3, 5, 7, 9]


def test_program_or_loop_is_decided_once():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(KIND_DECIDED_IN) or rel in CONNECTOR:
            continue
        found += [f"pilotrun/{rel}:{line}" for line in kind_tests(path.read_text())]
    assert not found, ("a module branches on program or loop: ask the object the spec's kind chose "
                       "(drivers.build.driver_class(spec), campaign.kinds.of(spec)), or add what differs to their "
                       f"tables: {', '.join(found)}")


# A gate row is a GateRow (ledger/records.py) outside the ledger, which keeps its JSON form: reading "gate" or
# "verdict" by key elsewhere is a dict that crossed a package boundary. plan.py's items are a plan's, not gate rows.
ROW_KEYS = re.compile(r"""\[["'](?:gate|verdict)["']\]|\.get\(["'](?:gate|verdict)["']""")
ROW_KEYS_ALLOWED = {"cli/plan.py"}


def test_gate_rows_are_read_typed_outside_the_ledger():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("ledger/") or rel in ROW_KEYS_ALLOWED:
            continue
        found += [f"pilotrun/{rel}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1)
                  if ROW_KEYS.search(line)]
    assert not found, f"a gate row read by string key (use GateRow: Ledger.gate_records, PilotResult.records): {found}"


def test_gate_declarations_are_consistent_and_derive_the_old_dependencies():
    from pilotrun.gates import registry

    assert registry.problems() == []
    deps = {g.name: registry.depends_on(g) for g in registry.GATES}
    assert deps == {"lock": (), "inspect": (), "split": (), "batch": (), "load": (), "first_step": ("load",),
                    "steady_step": ("first_step",), "accum_equivalence": ("load",), "eval": ("load",),
                    "save": ("first_step",), "export": ("load",), "restore": ("save",), "resume": ("first_step",),
                    "overfit": ("load",), "reload_eval": ("export", "load")}
    assert registry.job_memory_gates() == ("load", "first_step", "steady_step", "eval", "save", "export", "restore")


def test_the_registry_refuses_gates_out_of_step_with_the_gate_name_enum(monkeypatch):
    from pilotrun.gates import registry
    from pilotrun.gates.split import SplitGate

    def use(gates: list) -> list[str]:
        monkeypatch.setattr(registry, "GATES", tuple(gates))
        monkeypatch.setattr(registry, "GATE_NAMES", [g.name for g in gates])
        return registry.problems()

    declared = list(registry.GATES)
    swapped = list(declared)
    i = swapped.index(SplitGate)
    swapped[i - 1], swapped[i] = swapped[i], swapped[i - 1]  # split before inspect: neither reads the other's products
    assert [p.split(":")[0] for p in use(swapped)] == ["GateName and GATES must list the same gates in the same order"]

    class PlainSplit(SplitGate):
        name = "split"  # the text, not GateName.SPLIT

    assert use([PlainSplit if g is SplitGate else g for g in declared]) == [
        "gate names not taken from ledger.records.GateName: ['split']"]
    assert use(declared) == []


def test_an_unknown_gate_is_an_exception_that_lists_the_known_ones():
    from pilotrun.gates import UnknownGate, select_gates

    with pytest.raises(UnknownGate) as info:
        select_gates(["eval", "evaluate"])
    assert info.value.unknown == ["evaluate"] and "known: lock, inspect" in str(info.value)
    gates, notes = select_gates(["reload_eval"])
    assert [g.name for g in gates] == ["load", "export", "reload_eval"]
    assert notes == ["export added: reload_eval needs it", "load added: reload_eval needs it"]


def test_every_module_imports():
    import importlib

    for module in sorted(MODULES):
        if module != "pilotrun.__main__":
            importlib.import_module(module)


# -- the doc's "Where to add" lists ----------------------------------------------------------------------------------

DOC = PACKAGE.parent / "docs" / "architecture.md"


def _where_to_add() -> dict[str, str]:
    """The doc's "Where to add" entries: title -> the entry's text."""
    section = DOC.read_text().split("## Where to add", 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"^\*\*(.+?)\*\*", section, flags=re.M)
    return {title: body for title, body in zip(parts[1::2], parts[2::2])}


def _module_names(path: Path) -> set[str]:
    """Names bound at a module's top level (assignments, classes, functions)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def test_where_to_add_names_files_and_registries_that_exist():
    entries = _where_to_add()
    assert {"A gate", "A driver", "A strategy", "A framework integration", "A device backend",
            "An accelerator"} <= set(entries), sorted(entries)
    for title, body in entries.items():
        for line in body.splitlines():
            paths = re.findall(r"`(pilotrun/[\w/.]+\.(?:py|yaml))`", line)
            for path in paths:
                assert (PACKAGE.parent / path).exists(), f"{title}: {path} does not exist"
            if len(paths) == 1 and paths[0].endswith(".py"):
                for name in re.findall(r"`([A-Z][A-Z_]{2,})`", line):  # a registry the entry says to extend
                    assert name in _module_names(PACKAGE.parent / paths[0]), f"{title}: {paths[0]} defines no {name}"


def test_every_registered_extension_lives_where_the_doc_says_a_new_one_goes():
    from pilotrun import backends, strategies
    from pilotrun.drivers import DRIVERS
    from pilotrun.gates.registry import GATES

    entries = _where_to_add()
    registries = {"A gate": ("pilotrun/gates/<name>.py", GATES),
                  "A driver": ("pilotrun/drivers/<name>.py", DRIVERS.values()),
                  "A strategy": ("pilotrun/strategies/<name>.py", [type(s) for s in strategies.STRATEGIES.values()]),
                  "A device backend": ("pilotrun/backends/<name>.py", [type(b) for b in backends.BACKENDS])}
    for title, (template, members) in registries.items():
        assert f"`{template}`" in entries[title], f"{title}: the doc no longer says new ones go in {template}"
        package = template.rsplit("/", 1)[0].replace("/", ".")
        for member in members:
            assert member.__module__.startswith(package + "."), f"{member.__name__} lives in {member.__module__}"
    from pilotrun.program.describe import INTEGRATIONS

    # A module giving a callback or a begin() is an integration, and every integration is in the registry.
    integrations = sorted(p.stem for p in (PACKAGE / "integrations").glob("*.py")
                          if {"PilotrunCallback", "begin"} & _module_names(p))
    assert integrations == sorted(module for module, _ in INTEGRATIONS.values())
    assert "`pilotrun/integrations/<framework>.py`" in entries["A framework integration"]
    from pilotrun.cli.common import COMMANDS

    commands = sorted(p.stem for p in (PACKAGE / "cli").glob("*.py") if "add_parser" in _module_names(p))
    assert commands == sorted(COMMANDS), "each cli module with add_parser is a line in cli/common.py's COMMANDS"
    assert "`pilotrun/cli/<name>.py`" in entries["A command"]


def _gate_literals(node: ast.AST) -> list[str]:
    """Gate names written as text in ``node``: a string constant, or the constants of a tuple, list or set."""
    from pilotrun.ledger.records import GateName

    names = {str(g) for g in GateName}
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str) and i.value in names]


def gate_name_comparisons(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) wherever a gate name as text is compared (==, !=, in, not in, is) or looked up (``rows["load"]``,
    ``.get("load")``, ``.pop``, ``.setdefault``): code that reads rows must use ``GateName``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            found += [(node.lineno, n) for side in (node.left, *node.comparators) for n in _gate_literals(side)]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            found += [(node.lineno, n) for n in _gate_literals(node.slice)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args \
                and node.func.attr in ("get", "pop", "setdefault"):
            found += [(node.lineno, n) for n in _gate_literals(node.args[0])]
    return found


# (module, text): where a gate's name is compared as text outside gates/, and why that text is not the gate's name.
GATE_TEXT_ALLOWED = {
    ("pilotrun.estimate.cache", "eval"),        # the spec's eval: section (batch size, length) in the trace's key
    ("pilotrun.campaign.run_plan", "export"),   # the campaign's keep.export switch
    ("pilotrun.workers.train_phase", "restore"),  # the worker's --phase value (control, interrupted, resumed, restore)
    ("pilotrun.config.spec", "resume"),         # the spec's pilot.resume: section (its auto_within key)
}


def test_gate_names_are_compared_as_the_enum_outside_gates():
    found = []
    for module, path in MODULES.items():
        if module.startswith("pilotrun.gates"):
            continue  # the gates and their registry declare the names
        for line, name in gate_name_comparisons(ast.parse(path.read_text())):
            if (module, name) not in GATE_TEXT_ALLOWED:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line} {name!r}")
    assert not found, "gate names compared as text (use ledger.records.GateName): " + "; ".join(found)


def test_the_gate_name_check_finds_each_kind_of_comparison():
    src = """
a = row["gate"] == "load"
b = "eval" != name
c = g in ("inspect", "split")
d = rows["steady_step"]
e = rows.get("save", {})
f = rows["details"]
rows["export"] = 1
g = row["gate"] == GateName.LOAD
"""
    assert gate_name_comparisons(ast.parse(src)) == [(2, "load"), (3, "eval"), (4, "inspect"), (4, "split"),
                                                     (5, "steady_step"), (6, "save")]


def test_only_the_ledger_touches_its_sqlite_connection():
    found = [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}" for module, path in MODULES.items()
             if not module.startswith("pilotrun.ledger")
             for node in ast.walk(ast.parse(path.read_text()))
             if (isinstance(node, ast.Attribute) and node.attr == "conn")
             or (isinstance(node, ast.Import) and any(a.name == "sqlite3" for a in node.names))
             or (isinstance(node, ast.ImportFrom) and node.module == "sqlite3")]
    assert not found, "the ledger's SQLite connection or sqlite3 used outside ledger/ (add a Ledger method): " + "; ".join(
        found)


def test_one_runner_starts_every_pilot_run():
    """pilotrun's loop and a user's program are piloted by the same runner: no other module starts a pilot run."""
    starters = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "start_run"
                    and any(isinstance(a, ast.Attribute) and a.attr == "PILOT" for a in node.args)):
                starters.append(module)
    assert sorted(set(starters)) == ["pilotrun.pilot.runner"], starters


LONGEST_FUNCTION = 80  # lines, decorators excluded: a longer one is several steps that want names
LONGEST_MODULE = 800  # lines: split a module near this


def test_functions_and_modules_stay_short():
    long_functions, long_modules = [], []
    for path in MODULES.values():
        text = path.read_text()
        if text.count("\n") > LONGEST_MODULE:
            long_modules.append(f"{path.relative_to(PACKAGE.parent)} ({text.count(chr(10))} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONGEST_FUNCTION:
                    long_functions.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines})")
    assert not long_functions, f"functions over {LONGEST_FUNCTION} lines: " + "; ".join(long_functions)
    assert not long_modules, f"modules over {LONGEST_MODULE} lines: " + "; ".join(long_modules)


# -- the extension surface: pilotrun/integrations/README.md and pilotrun/gates/README.md ----------------------------

ROOT = PACKAGE.parent


def _readme_rows(readme: Path) -> dict[str, str]:
    """A README's table of touched files: path -> the row's "when" cell."""
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+) \|", readme.read_text(), flags=re.M)
    return {path: when.strip() for path, when in rows}


def _fw_module(fw) -> str | None:
    from pilotrun.program.describe import INTEGRATIONS

    entry = INTEGRATIONS.get(fw)
    return entry[0] if entry else None


VIEW_BASES = ("FrameworkView", "HandLoopView")  # gates/view.ViewBase's subclasses an integration's view derives from


def _fw_view_and_entry(fw) -> str | None:
    """The module gives a callback or ``begin`` and a view. Read, not imported (the frameworks are slow to import):
    that the view implements every method is checked when its class is defined, which test_every_module_imports
    does."""
    module = _fw_module(fw)
    path = PACKAGE / "integrations" / f"{module}.py"
    if module is None or not path.is_file():
        return f"no pilotrun/integrations/{module}.py"
    views = [node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
             and any(ast.unparse(base).split(".")[-1] in VIEW_BASES for base in node.bases)]
    if not views:
        return f"{path.name} defines no view (a subclass of {' or '.join(VIEW_BASES)})"
    return None if {"PilotrunCallback", "begin"} & _module_names(path) else f"{path.name} has no PilotrunCallback or begin"


def _fw_describer(fw) -> str | None:
    from pilotrun.program import describe

    if _fw_module(fw) is None:
        return f"{fw!r} has no line in describe.INTEGRATIONS"
    if f"Framework.{getattr(fw, 'name', fw)}" not in inspect.getsource(describe.program_frameworks):
        return f"describe.program_frameworks does not read a program's files as using {fw}"
    return None


def _named_in(text: str, where: str) -> Callable[[object], str | None]:
    def check(fw) -> str | None:
        module = _fw_module(fw)
        return None if module and module.lower() in text.lower() else f"{where} does not name the {module} integration"
    return check


def _on_program_row() -> str:
    table = (ROOT / "docs" / "reference" / "gates.md").read_text().split("| gate | on a program |", 1)[1]
    return next(line for line in table.splitlines() if line.startswith("|") and "`inspect`" in line.split("|")[1])


def _third_party_imports(path: Path) -> set[str]:
    """The top-level packages outside the standard library ``path`` imports; one imported in an ``except`` branch is
    a fallback for an older layout (``lightning_fabric`` for ``lightning.fabric``), not a requirement."""
    tree = ast.parse(path.read_text())
    fallback = {id(n) for h in ast.walk(tree) if isinstance(h, ast.ExceptHandler) for n in ast.walk(h)}
    tops = set()
    for node in ast.walk(tree):
        if id(node) in fallback:
            continue
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            tops.add(node.module.split(".")[0])
    return {t for t in tops if t not in sys.stdlib_module_names and t not in ("pilotrun", "__future__")}


@functools.cache
def _distributions() -> dict[str, list[str]]:
    import importlib.metadata

    return importlib.metadata.packages_distributions()


def _fw_declared(fw) -> str | None:
    """Every distribution the integration imports is a dependency or an optional extra of pyproject.toml."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower().replace("_", "-")
                for d in project["dependencies"] + [d for ds in project["optional-dependencies"].values() for d in ds]}
    dists = _distributions()
    path = PACKAGE / "integrations" / f"{_fw_module(fw)}.py"
    if not path.is_file():
        return None  # the first row says it is missing; it imports nothing
    missing = sorted({d.lower().replace("_", "-") for top in _third_party_imports(path) for d in dists.get(top, [top])}
                     - declared)
    return f"{path.name} imports {missing}, declared nowhere in pyproject.toml" if missing else None


# Whether each integration's framework has a launcher of its own (its words), decided once per framework: a new
# one fails until it is added here, and a launcher then must be wired into both files the README names.
LAUNCHERS: dict[str, tuple[str, ...] | None] = {"transformers": None, "lightning": None,
                                                "fabric": ("fabric", "run"), "accelerate": ("accelerate", "launch")}


def _fw_launcher(where: str) -> Callable[[object], str | None]:
    def check(fw) -> str | None:
        from pilotrun.config import program as config_program
        from pilotrun.program.runner import command_words

        module = _fw_module(fw)
        if module not in LAUNCHERS:
            return f"{module}: say in test_architecture.LAUNCHERS whether its framework has a launcher of its own"
        words = LAUNCHERS[module]
        if words is None:
            return None
        if where == "config" and words not in vars(config_program).values():
            return f"config/program.py has no constant for the launcher {' '.join(words)!r}"
        if where == "config" and not config_program.program_file_problems(
                types.SimpleNamespace(words=[*words, "missing.py"], files=None), ROOT):
            return f"config/program.py does not find the script of {' '.join(words)!r}"
        if where == "runner" and command_words([*words, "t.py"])[:2] != [sys.executable, "-m"]:
            return f"program/runner.command_words does not resolve {' '.join(words)!r} to this interpreter"
        return None
    return check


def _fw_test(fw) -> str | None:
    path = ROOT / "tests" / "integrations" / f"test_integration_{_fw_module(fw)}.py"
    return None if path.is_file() else f"no {path.relative_to(ROOT)}"


def framework_checks() -> dict[str, Callable[[object], str | None]]:
    """pilotrun/integrations/README.md's rows, each with what shows a framework is wired into that file."""
    from pilotrun.gates.base import NEEDS_INTEGRATION

    return {"pilotrun/integrations/<module>.py": _fw_view_and_entry,
            "pilotrun/program/describe.py": _fw_describer,
            "pilotrun/gates/base.py": _named_in(NEEDS_INTEGRATION, "gates/base.py's NEEDS_INTEGRATION"),
            "docs/reference/gates.md": _named_in(_on_program_row(), "docs/reference/gates.md's on-a-program row"),
            "pyproject.toml": _fw_declared,
            "pilotrun/config/program.py": _fw_launcher("config"),
            "pilotrun/program/runner.py": _fw_launcher("runner"),
            "docs/guides/integrations.md": _named_in((ROOT / "docs/guides/integrations.md").read_text(),
                                                    "docs/guides/integrations.md"),
            "README.md": _named_in((ROOT / "README.md").read_text(), "README.md"),
            "tests/integrations/test_integration_<module>.py": _fw_test}


def _wired(readme: str, checks: dict[str, Callable[[object], str | None]], members) -> None:
    """``readme``'s table lists exactly ``checks``' files, each of them exists, and every member passes each."""
    rows = _readme_rows(PACKAGE / readme)
    assert sorted(rows) == sorted(checks), f"pilotrun/{readme}'s table and its checks differ"
    for path in rows:
        assert "<" in path or (ROOT / path).exists(), f"pilotrun/{readme} lists {path}, which is gone"
    problems = [p for member in members for check in checks.values() if (p := check(member))]
    assert not problems, "; ".join(problems)


def test_every_framework_is_wired_into_each_file_the_readme_lists():
    from pilotrun.program.describe import Framework

    _wired("integrations/README.md", framework_checks(), Framework)


def test_the_framework_check_fails_a_framework_wired_into_nothing():
    from pilotrun.program.describe import INTEGRATIONS, Framework

    new = enum.Enum("Extra", {"MXNET": "MXNet Gluon"}).MXNET  # type: ignore[attr-defined]
    INTEGRATIONS[new] = ("mxnet", "pilotrun.integrations.mxnet.begin(...)")  # type: ignore[index]
    try:
        failed = {path for path, check in framework_checks().items() if check(new)}
    finally:
        del INTEGRATIONS[new]  # type: ignore[arg-type]
    # Every row but pyproject's (a module that does not exist imports nothing undeclared) catches it.
    assert failed == set(framework_checks()) - {"pyproject.toml"}
    assert _fw_describer(Framework.FABRIC) is None and _fw_launcher("runner")(Framework.FABRIC) is None


def _gate_module(gate) -> str | None:
    module = sys.modules[gate.__module__]
    return None if gate.__module__.startswith("pilotrun.gates.") and Path(module.__file__).parent == PACKAGE / "gates" \
        else f"{gate.__name__} lives in {gate.__module__}, not pilotrun/gates/"


def _gate_name(gate) -> str | None:
    from pilotrun.ledger.records import GateName

    return None if isinstance(gate.name, GateName) else f"{gate.__name__}.name {gate.name!r} is not a GateName member"


def _gate_registered(gate) -> str | None:
    from pilotrun.gates import registry

    return None if gate in registry.GATES and not registry.problems() else f"{gate.__name__} is not in registry.GATES"


def _integration_only(check: Callable[[object], str | None]) -> Callable[[object], str | None]:
    def only(gate) -> str | None:
        from pilotrun.gates.base import OnProgram

        return check(gate) if gate.on_program == OnProgram.INTEGRATION else None
    return only


def _probed(gate) -> str | None:
    from pilotrun.gates.base import Gate

    # integrations.common.run_probes reads the registry: a gate run on a framework's view needs its probe, no line there.
    return None if gate.probe is not Gate.probe else f"{gate.name} runs on a framework's view but defines no probe"


def _gate_module_and_probe(gate) -> str | None:
    return _gate_module(gate) or _integration_only(_probed)(gate)


def _doc_row(doc: str, tables: tuple[str, ...]) -> Callable[[object], str | None]:
    def check(gate) -> str | None:
        text = (ROOT / doc).read_text()
        for heading in tables:
            if heading not in text:
                return f"{doc} has no table {heading!r} (renamed? update gate_checks)"
            table = text.split(heading, 1)[1].split("\n\n", 1)[0]
            firsts = [line.split("|")[1] for line in table.splitlines() if line.startswith("|")]
            if not any(f"`{gate.name}`" in cell for cell in firsts):
                return f"{doc}: no row for {gate.name} in the table {heading!r}"
        return None
    return check


def gate_checks() -> dict[str, Callable[[object], str | None]]:
    """pilotrun/gates/README.md's rows, each with what shows a gate is wired into that file."""
    return {"pilotrun/gates/<module>.py": _gate_module_and_probe,
            "pilotrun/ledger/records.py": _gate_name,
            "pilotrun/gates/registry.py": _gate_registered,
            "docs/guides/integrations.md": _integration_only(_doc_row("docs/guides/integrations.md",
                                                                      ("| gate | how, on the framework's own code |",))),
            "docs/reference/gates.md": _doc_row("docs/reference/gates.md",
                                                ("| gate | what it proves | fails when |", "| gate | on a program |"))}


def test_every_gate_is_wired_into_each_file_the_readme_lists():
    from pilotrun.gates.registry import GATES

    _wired("gates/README.md", gate_checks(), GATES)


def test_the_gate_check_fails_a_gate_wired_into_nothing():
    from pilotrun.gates.base import OnProgram
    from pilotrun.gates.overfit import OverfitGate

    class MemorizeGate(OverfitGate):  # declared here, registered nowhere, documented nowhere
        name = "memorize"
        on_program = OnProgram.INTEGRATION

    failed = {path for path, check in gate_checks().items() if check(MemorizeGate)}
    assert failed == set(gate_checks())
    assert _probed(OverfitGate) is None


def test_a_view_class_is_checked_when_it_is_defined():
    from pilotrun.gates.view import TrainingView, ViewBase
    from pilotrun.integrations.common import FrameworkView
    from pilotrun.integrations.loops import HandLoopView

    with pytest.raises(TypeError, match=r"Partial is a training view that does not implement accum_windows, batching, "
                                        r"export, loss, model, normalisation_cause"):
        class Partial(HandLoopView):  # at definition: no instance is ever made
            pass

    class Base(FrameworkView, abstract=True):  # a base may leave methods to its subclasses
        pass

    with pytest.raises(TypeError, match="does not implement .*accumulate"):
        class FromBase(Base):
            pass
    # No view class escapes the check: the protocol's one subclass is the checked base.
    assert TrainingView.__subclasses__() == [ViewBase]


def test_the_tests_mirror_the_packages():
    """tests/<package>/ holds pilotrun/<package>/'s tests; tests/README.md lists every folder and the root's
    cross-cutting modules, and nothing else sits at the root."""
    root = Path(__file__).parent
    readme = (root / "README.md").read_text()
    folders = {p.name for p in root.iterdir() if p.is_dir() and p.name not in ("fixtures", "__pycache__")}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders <= packages, f"test folders named for no package: {sorted(folders - packages)}"
    assert all((root / f / "__init__.py").is_file() for f in folders)
    listed = set(re.findall(r"^\| `(\w+)/` \|", readme, re.M))
    assert listed == folders, f"tests/README.md's layout table and the folders differ: {sorted(listed ^ folders)}"
    cross = readme.split("Cross-cutting, at the root:", 1)[1]
    at_root = {p.name for p in root.glob("test_*.py")}
    assert at_root == set(re.findall(r"`(test_\w+\.py)`", cross)), "tests/README.md's root list and the root differ"
