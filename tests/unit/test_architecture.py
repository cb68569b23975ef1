"""The package's import rules (DESIGN.md §2, "Repository layout"), read off the source with `ast`.

- No import cycles among the modules of `mobius_fx` and `mobius_fx.passes` (`passes/`),
  counting every import statement: at module level, under `if TYPE_CHECKING:` and inside
  functions. A type-only or lazy import still makes two modules depend on each other's
  definitions; it only hides the cycle from the interpreter.
- The passes do not import `mobius_fx.planning.plans`: the model they share is `mobius_fx.planning.step_model`.
- One import path per name (issue 37 part 5): a module's `__all__` lists only what it defines; no
  re-export shims (a package's `__init__` is its public face). Exceptions: KNOWN_REEXPORTS.
- A built pipeline is complete (issue 37 part 5): no module outside `mobius_fx/runtime/` and
  `build.py` touches a Pipeline's or Runtime's private attributes (compile hands `build_pipeline`
  its `Wiring`), nor `object.__setattr__`s another object.
- Runtime inputs are typed (issue 37 part 5): no parameter of a function in `mobius_fx/runtime/`
  is annotated `Any`; exceptions are named in KNOWN_ANY_PARAMETERS / KNOWN_ANY_MODULES with the reason.
- The passes import nothing of the runtime (issue 37 part 5): the op contract they share with it
  (`StageSpec`, the `Schedule` the runtime reads, the ops) is `mobius_fx.planning.stage_contract`.
- No module imports a private name (`_x`) that another module defines, neither with
  `from m import _x` nor as `m._x`. A private *module* (`passes/_partition_mip.py`) is private to its package: modules of that package import it.
- One home per list (issue 29): each kind list of `mobius_fx/kinds.py` (device kinds, solvers,
  schedules, optimizer-overlap modes) and `plans.TRANSFER_KIND` (schedule IR op kind -> transfer
  kind) is written out only there; a literal tuple, list or set holding two of a list's names (or
  a dict with two of TRANSFER_KIND's pairs) anywhere else in `mobius_fx`, `passes/` or
  `benchmarks/` is a second copy: import the list instead.
- One schedule language (issue 29): a schedule is a module of `mobius_fx/schedules/` registered
  by name (`mobius_fx.schedules.register`); no literal lists two schedule names (the registry is
  the list), no module outside that package compares a value with a schedule's name, and only
  the task builder from the schedule IR (`schedules/ir_tasks.py`), the task graph
  (`sim/tasks.py`) and the event engine (`sim/network.py`) make simulator tasks (every module of
  `mobius_fx/schedules/` and `mobius_fx/sim/` is read, and any other that imports the task graph);
  the IR's stage description (`StageIO`) is built only by its named constructors in
  `mobius_fx/planning/schedule_ir.py` (from the plan, the traced graph, the runtime).
- One home per rule: the micro-batch count's rules live in `mobius_fx/planning/microbatch.py`
  (`check_count`, `check_divides`); the divisibility message is written in no other module.
- One precision record (issue 29 part 2): the dtype alias table (`precision.DTYPE_ALIASES`) is
  written only in `mobius_fx/precision.py` (no other dict keyed by two of its aliases), and a
  `MemoryModel` is built only where a problem (`step_model`) or a plan (`plans`) is made; the
  rest read the one they carry.
- Sizes (issue 29; a guide since issue 37: a file may be long when it holds one idea): a module of
  `mobius_fx` or `passes/` over `MAX_FILE_LINES` (500) lines, or a function or method over
  `MAX_FUNCTION_LINES` (80, decorators excluded), is named in `LONG_FILES` / `LONG_FUNCTIONS` with
  the reason. An entry that no longer exceeds fails too, so the lists stay true.
- Phases (issue 29 part 4): every module has a phase -- base (errors, units, kinds, precision),
  trace, topology, planning, sim (with schedules) | runtime, passes, front (api, compiler,
  options, build, pass_adapters, the CLI) -- and imports only its own phase or earlier ones;
  sim and runtime are siblings. Exceptions are named in KNOWN_PHASE_EDGES with the reason.
- One file per device kind (issue 29 part 4): each kind of `kinds.DEVICES` but "auto" has its
  module `runtime/device_<kind>.py` defining exactly one Device class; no other module defines
  one, except the shared bases (`Device`, `StreamDevice`) in DEVICE_BASES.
- "Stage" means one thing (issue 29 part 4): a pipeline stage (docs/architecture.md, "Glossary").
  No name in `mobius_fx` or `passes/` -- identifier, attribute, argument or a key-like string
  constant -- uses the verb ("staged", "staging"): a pinned copy is a pin, a copy through host
  memory is relayed. Exceptions are named in KNOWN_STAGING_NAMES with the reason (one: an old key's hint).
- Benchmarks and examples stand on the package alone (issue 29 part 4): no file under
  `benchmarks/` or `examples/` imports `tests` or puts a `tests/` folder on `sys.path`; the
  models they share with the tests live in the package's zoo (`mobius_fx/zoo/`).

Run as a script to print the import graph's cycles: `python tests/unit/test_architecture.py`.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"mobius_fx": ROOT / "mobius_fx", "mobius_fx.passes": ROOT / "passes"}  # pyproject package-dir

# Known violations, each named so that a new one fails (a stale entry fails too). None now:
# keep it that way, or name an exception here with the reason.
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()
# Literals that pick some names of a kind list on purpose (not a copy of it): (module, the names) -> why.
KNOWN_SELECTIONS: dict[tuple[str, frozenset], str] = {
    ("benchmarks.gpu_check", frozenset({"cuda", "virtual"})): "--device: the two kinds the GPU check trains on",
    ("benchmarks.paper", frozenset({"zero3-offload", "mobius-identity-map", "roundpipe"})):
        "the speedup table's columns, in the README's order",
    ("benchmarks.paper", frozenset({"mobius", "roundpipe"})): "the overlap table: the schedules with an optimizer overlap",
}


@functools.lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    """The syntax tree of `path`, parsed once for all the rules that read it."""
    return ast.parse(path.read_text(), str(path))


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package, subpackages included."""
    mods = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join((pkg, *parts))] = path
    return mods


MODULES = _modules()


@dataclass(frozen=True)
class Import:
    """One imported name: `importer` line `line` takes `name` (None: the module itself) from
    `target`, a module of the package."""

    importer: str
    target: str
    name: str | None
    line: int


def _package_module(dotted: str) -> str | None:
    """The longest prefix of `dotted` that is a module of the package, else None (external)."""
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def package_of(module: str) -> str:
    return module if MODULES[module].stem == "__init__" else module.rpartition(".")[0]


def imports_of(module: str) -> list[Import]:
    """Every import statement of `module` that reaches the package, wherever it stands."""
    path, package = MODULES[module], package_of(module)
    out = []
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _package_module(alias.name)
                if target:
                    out.append(Import(module, target, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in MODULES:  # `from pkg import module`
                    out.append(Import(module, sub, None, node.lineno))
                elif (target := _package_module(base)):
                    out.append(Import(module, target, alias.name, node.lineno))
    return out


def import_graph() -> nx.DiGraph:
    """Module -> the modules it imports (edges carry the line numbers)."""
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for module in MODULES:
        for imp in imports_of(module):
            if imp.target != module:
                graph.add_edge(module, imp.target)
                graph.edges[module, imp.target].setdefault("lines", []).append(imp.line)
    return graph


def _describe(graph: nx.DiGraph, cycle: list[str]) -> str:
    steps = zip(cycle, cycle[1:] + cycle[:1])
    return " -> ".join(f"{a} (line {graph.edges[a, b]['lines'][0]})" for a, b in steps) + f" -> {cycle[0]}"


def test_no_import_cycles():
    graph = import_graph()
    stale = [e for e in KNOWN_CYCLE_EDGES if not graph.has_edge(*e)]
    assert not stale, f"{stale} no longer import each other: remove them from KNOWN_CYCLE_EDGES"
    graph.remove_edges_from(KNOWN_CYCLE_EDGES)
    cycles = sorted(nx.simple_cycles(graph), key=len)
    assert not cycles, ("modules import each other (counting TYPE_CHECKING and function-level imports); "
                        "move what both need into a module both import:\n"
                        + "\n".join(_describe(graph, c) for c in cycles[:10]))


def test_passes_do_not_import_plans():
    found = [f"{imp.importer} line {imp.line}" for module in MODULES if module.startswith("mobius_fx.passes.")
             for imp in imports_of(module) if imp.target == "mobius_fx.planning.plans"]
    assert not found, (f"passes import mobius_fx.planning.plans: {found}; import the step model where it is defined "
                       f"(MemoryModel, stage_memory: mobius_fx.planning.step_memory; SolverInfo: "
                       f"mobius_fx.planning.step_model)")


def passes_importing_the_runtime() -> list[str]:
    """'importer line N: target' for every import of a `mobius_fx.runtime` module by a pass."""
    return [f"{imp.importer} line {imp.line}: {imp.target}" for module in MODULES if module.startswith("mobius_fx.passes.")
            for imp in imports_of(module) if imp.target.startswith("mobius_fx.runtime")]


def test_passes_do_not_import_the_runtime():
    found = passes_importing_the_runtime()
    assert not found, (f"passes import the runtime: {found}; what the passes and the runtime share (StageSpec, the "
                       f"Schedule the runtime reads, the ops the program calls) is the contract of "
                       f"mobius_fx.planning.stage_contract: import it from there, or add it there")


# Modules whose `__all__` still lists names defined elsewhere (module -> why). Each is a file
# another change of issue 37 rewrites now; the lead drops the entry when it lands.
KNOWN_REEXPORTS: dict[str, str] = {
}


def reexports() -> dict[str, list[str]]:
    """module -> the names its `__all__` lists but takes from another module of the package (a
    package's `__init__` is its public face and may)."""
    out = {}
    for module, path in MODULES.items():
        if path.stem == "__init__":
            continue
        tree = parsed(path)
        listed = [e.value for n in tree.body if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
                  for e in getattr(n.value, "elts", ()) if isinstance(e, ast.Constant)]
        taken = {imp.name for imp in imports_of(module) if imp.name is not None and imp.target != module}
        found = sorted(name for name in listed if name in taken)
        if found:
            out[module] = found
    return out


def test_no_module_re_exports_another_modules_names():
    found = reexports()
    stale = sorted(set(KNOWN_REEXPORTS) - set(found))
    assert not stale, f"{stale} re-export nothing now: remove them from KNOWN_REEXPORTS"
    new = sorted(f"{module}: {names}" for module, names in found.items() if module not in KNOWN_REEXPORTS)
    assert not new, ("modules list names of other modules in __all__ (a second import path for one name); import "
                     "each name from the module that defines it, and list in __all__ only what the module "
                     "defines:\n" + "\n".join(new))


def _private_name_uses(module: str) -> list[tuple[str, str, int]]:
    """(defining module, private name, line) of every private name `module` takes from another
    module of the package: `from m import _x`, `import m as a; a._x`, `from m import C; C._x`,
    and private modules of another package."""
    found, bound = [], {}
    for imp in imports_of(module):
        if imp.target == module:
            continue
        leaf = imp.target.rpartition(".")[2]
        if leaf.startswith("_") and leaf != "__init__" and package_of(imp.target) != package_of(module):
            found.append((package_of(imp.target), leaf, imp.line))  # a private module of another package
        if imp.name is not None and imp.name.startswith("_") and not imp.name.startswith("__"):
            found.append((imp.target, imp.name, imp.line))
    tree = ast.parse(MODULES[module].read_text())
    for node in ast.walk(tree):  # names bound to what was imported from the package
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".")[0]] = node
    package_bound = {name for name, node in bound.items()
                     if (isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("mobius_fx")))
                     or (isinstance(node, ast.Import) and name == "mobius_fx")}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in package_bound
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append((node.value.id, node.attr, node.lineno))
    return found


def test_no_private_names_imported_across_modules():
    uses = {(module, origin, name): line for module in MODULES
            for origin, name, line in _private_name_uses(module)}
    stale = KNOWN_PRIVATE_IMPORTS - set(uses)
    assert not stale, f"{sorted(stale)} are gone: remove them from KNOWN_PRIVATE_IMPORTS"
    new = sorted(f"{m} line {line}: {name} from {origin}" for (m, origin, name), line in uses.items()
                 if (m, origin, name) not in KNOWN_PRIVATE_IMPORTS)
    assert not new, ("modules use private names of other modules; make the name public (no leading "
                     "underscore, in __all__) or move it to the module that uses it:\n" + "\n".join(new))


# ----------------------------------------------------------------------------- one home per list and rule

SCANNED = {**MODULES, **{f"benchmarks.{p.stem}": p for p in sorted((ROOT / "benchmarks").glob("*.py"))}}


def _kind_lists() -> dict[str, tuple[str, frozenset]]:
    """name -> (its home module, its members) for every list that must be written out once. The
    schedules are a registry, not a list: each module of `mobius_fx/schedules/` registers its
    own name, so no module (the registry included) writes two of them out."""
    from mobius_fx import kinds, schedules
    from mobius_fx.planning import plans

    lists = {name: ("mobius_fx.kinds", frozenset(getattr(kinds, name))) for name in kinds.__all__}
    lists["TRANSFER_KIND"] = ("mobius_fx.planning.plans", frozenset(plans.TRANSFER_KIND.items()))
    lists["schedules"] = ("mobius_fx.schedules.registry", frozenset(schedules.names()))
    return lists


def _literal(node: ast.AST) -> frozenset | None:
    """The members of a literal tuple/list/set of str (a dict: its str keys, and its pairs of
    str -> str: a table keyed by a kind list's names is a copy of the list too)."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        values = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        return frozenset(values)
    if isinstance(node, ast.Dict):
        keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        return frozenset(keys) | frozenset((k.value, v.value) for k, v in zip(node.keys, node.values)
                                           if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)
                                           and isinstance(k.value, str) and isinstance(v.value, str))
    return None


def kind_list_copies() -> tuple[list[str], set]:
    """Where a literal outside a list's home holds two or more of its members (`__all__` names
    functions, not kinds: skipped), and the KNOWN_SELECTIONS seen."""
    lists, found, seen = _kind_lists(), [], set()
    for module, path in SCANNED.items():
        tree = parsed(path)
        exports = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)}
        for node in ast.walk(tree):
            members = _literal(node)
            if not members or id(node) in exports:
                continue
            if (module, members) in KNOWN_SELECTIONS:
                seen.add((module, members))
                continue
            for name, (home, kinds) in lists.items():
                if module != home and len(members & kinds) >= 2:
                    found.append(f"{module} line {node.lineno}: {sorted(members & kinds)} (a copy of {home}.{name})")
    return found, seen


def test_each_kind_list_is_written_once():
    copies, seen = kind_list_copies()
    stale = sorted(str(k) for k in set(KNOWN_SELECTIONS) - seen)
    assert not stale, f"{stale} are gone: remove them from KNOWN_SELECTIONS"
    assert not copies, ("a kind list is written out a second time; import it from its home (mobius_fx.kinds, "
                        "plans.TRANSFER_KIND, mobius_fx.schedules.names()) instead, so the two cannot drift:\n"
                        + "\n".join(copies))


# ----------------------------------------------------------------------------- one schedule language

SCHEDULES = "mobius_fx.schedules"
# The modules that make simulator tasks: the one task builder from the schedule IR, the task
# graph's own primitives (streams, the host's optimizer and copies, all-reduce) and the event
# engine (`network.run_flows`: flows on an idle network).
TASK_BUILDERS = {f"{SCHEDULES}.ir_tasks", "mobius_fx.sim.tasks", "mobius_fx.sim.network"}
TASK_CALLS = {"compute", "move", "mark", "pin_copy"}  # sim.tasks.Context's task makers (its `add` takes a Task)


def schedule_languages() -> dict[str, list[str]]:
    """module -> how it builds simulator tasks itself: a `Task(...)`, or a call of a `Context`
    task maker (on any object), in every module of mobius_fx/schedules/ and mobius_fx/sim/ and
    in any other module that imports the task graph (`mobius_fx.sim.tasks`, `mobius_fx.sim.network`)."""
    found: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        targets = {imp.target for imp in imports_of(module)}
        if not module.startswith((f"{SCHEDULES}.", "mobius_fx.sim.")) \
                and not targets & {"mobius_fx.sim.tasks", "mobius_fx.sim.network"}:
            continue
        for node in ast.walk(parsed(path)):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if (isinstance(f, ast.Attribute) and name in TASK_CALLS) or name == "Task":
                found.setdefault(module, []).append(f"line {node.lineno}: {name}(...)")
    return found


def test_one_schedule_language():
    """A schedule is a module of mobius_fx/schedules/ registered by name; the simulator makes its
    tasks only through the task builder from the IR (and the task graph's primitives)."""
    found = schedule_languages()
    outside = {m: how for m, how in found.items() if m not in TASK_BUILDERS}
    assert not outside, ("modules build simulator tasks outside the schedules package's task builder "
                         f"({', '.join(sorted(TASK_BUILDERS))}): {outside}; make the schedule a module of "
                         "mobius_fx/schedules/ that produces the schedule IR and hands it to "
                         "ir_tasks.tasks_from_ir")
    assert {m for m in found if m.startswith(f"{SCHEDULES}.")} == {f"{SCHEDULES}.ir_tasks"}, found


def stage_descriptions() -> list[str]:
    """Where a module other than `mobius_fx.planning.schedule_ir` builds the IR's stage description itself
    (`StageIO(...)`, `StageInput(...)`) instead of with a named constructor (`StageIO.from_plan`,
    `.from_graph`, `.from_runtime`)."""
    found = []
    for module, path in MODULES.items():
        if module == "mobius_fx.planning.schedule_ir":
            continue
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if name in ("StageIO", "StageInput"):
                    found.append(f"{module} line {node.lineno}: {name}(...)")
    return found


def test_the_ir_is_described_by_one_record_with_named_constructors():
    found = stage_descriptions()
    assert not found, ("the schedule IR's stages are described outside mobius_fx/planning/schedule_ir.py; add or use a named "
                       "constructor there (StageIO.from_plan, from_graph, from_runtime):\n" + "\n".join(found))


def schedule_name_branches() -> list[str]:
    """Where a module of `mobius_fx` outside the schedules package that runs schedules (imports
    the schedules, the simulator, its task graph or the report) compares a value with a
    registered schedule's name (`if schedule == "gpipe"`): behaviour that belongs to the
    schedule's own module or its registry entry."""
    from mobius_fx import schedules

    registered = set(schedules.names())
    users = {"mobius_fx.sim.simulator", "mobius_fx.sim.tasks", "mobius_fx.sim.report"}
    found = []
    for module, path in MODULES.items():
        targets = {imp.target for imp in imports_of(module)}
        if module == SCHEDULES or module.startswith(f"{SCHEDULES}.") or not (
                targets & users or any(t == SCHEDULES or t.startswith(f"{SCHEDULES}.") for t in targets)):
            continue
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Compare):
                for c in ast.walk(node):
                    if isinstance(c, ast.Constant) and c.value in registered:
                        found.append(f"{module} line {node.lineno}: compares with {c.value!r}")
    return found


def test_no_module_branches_on_a_schedule_name():
    found = schedule_name_branches()
    assert not found, ("code outside mobius_fx/schedules/ branches on a schedule's name; give the schedule's "
                       "registry entry a field (schedules.register(..., data_parallel=, optimizer=)) or move the "
                       "behaviour into its module:\n" + "\n".join(found))


DIVIDES_MESSAGE = ("must divide the batch", "equal micro-batches")


def divisibility_messages() -> dict[str, list[int]]:
    """module -> the lines of its string constants that word the divisibility rule."""
    found: dict[str, list[int]] = {}
    for module, path in SCANNED.items():
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and any(m in node.value for m in DIVIDES_MESSAGE):
                found.setdefault(module, []).append(node.lineno)
    return found


def test_the_divisibility_rule_has_one_home():
    found = divisibility_messages()
    assert set(found) == {"mobius_fx.planning.microbatch"}, (
        f"the micro-batch divisibility message is worded in {sorted(found)} (lines {found}); raise it with "
        f"mobius_fx.planning.microbatch.check_divides (its batch/count/remedy arguments say how the caller spells them)")


def alias_tables() -> list[str]:
    """Dict literals outside mobius_fx.precision keyed by two or more dtype aliases ("bf16", "fp16", ...)."""
    from mobius_fx.precision import DTYPE_ALIASES

    found = []
    for module, path in SCANNED.items():
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Dict) and module != "mobius_fx.precision":
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                if len(keys & set(DTYPE_ALIASES)) >= 2:
                    found.append(f"{module} line {node.lineno}: {sorted(keys & set(DTYPE_ALIASES))}")
    return found


def test_the_dtype_alias_table_has_one_home():
    found = alias_tables()
    assert not found, ("a dtype alias table is written outside mobius_fx/precision.py; read dtypes with "
                       "precision.parse_dtype (or Precision.check_request) instead:\n" + "\n".join(found))


def memory_model_builds() -> dict[str, list[int]]:
    """module -> the lines where it calls `MemoryModel(...)`."""
    found: dict[str, list[int]] = {}
    for module, path in MODULES.items():
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Call) and (getattr(node.func, "id", None) == "MemoryModel"
                                               or getattr(node.func, "attr", None) == "MemoryModel"):
                found.setdefault(module, []).append(node.lineno)
    return found


def test_memory_models_are_built_where_problems_and_plans_are_made():
    found = memory_model_builds()
    assert set(found) <= {"mobius_fx.planning.step_model", "mobius_fx.planning.plans"}, (
        f"MemoryModel is built in {found}; read the one the problem (PartitionProblem.memory) or the plan "
        f"(Plan.memory) carries, or its Precision's scale")


# ----------------------------------------------------------------------------- sizes

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80  # def line to last line (FunctionDef.end_lineno - lineno + 1)
# Named exceptions to the limits (none now): a table, say, with the reason.
LONG_FILES: set[str] = {
    "mobius_fx.tracing",  # one idea (capture the model as one graph: the two front ends, the cache, the trace-time model state); issue 37: the limits are guidance
    "mobius_fx.runtime.overlap",  # one class, OverlapOptimizer (issue 37: no longer split into mixins to stay under a line count)
    "mobius_fx.runtime.host_kernel",  # one idea: the fused host pass's C++ source (one string, torch's fused Adam loop extended) and its build
    "mobius_fx.runtime.engine",  # one class, Runtime: the schedule's ops on the devices and the stage calls, forward and backward (issue 37: StageCalls no longer a mixin in a file of its own)
    "mobius_fx.runtime.device_books",  # one idea: the Device interface (the abstract class, each method its contract) and the books every kind keeps
    "mobius_fx.planning.schedule_ir",  # one idea: the step as ops (Op, ScheduleIR) and its one builder (Mobius's order, a backward GPU per stage)
    "mobius_fx.runtime.executor",  # one class, StepExecutor: one handler per op kind and phase, over every schedule's runtime form
    "mobius_fx.api",  # one idea: the public entry points (plan, compile, simulate) with their documented arguments, and compile's wiring
}
LONG_FUNCTIONS: set[tuple[str, str]] = {  # one idea each, long by nature (issue 37: the limits are guidance)
    ("mobius_fx.__main__", "_parser"),  # the CLI's arguments, one add_argument each
    ("mobius_fx.build", "build_pipeline"),  # the one builder of a complete Pipeline: its docstring documents every argument
    ("mobius_fx.api", "compile"),  # the public entry point: its docstring documents every argument
}


def file_lines() -> dict[str, int]:
    """module -> its number of lines, for the modules over MAX_FILE_LINES."""
    sizes = {module: len(path.read_text().splitlines()) for module, path in MODULES.items()}
    return {module: n for module, n in sizes.items() if n > MAX_FILE_LINES}


def function_lines(source: str) -> dict[str, int]:
    """qualified name (`Class.method`, `outer.inner`) -> lines, for every function of `source`
    over MAX_FUNCTION_LINES."""
    found: dict[str, int] = {}

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef) and child.end_lineno - child.lineno + 1 > MAX_FUNCTION_LINES:
                    found[name] = child.end_lineno - child.lineno + 1
                walk(child, f"{name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return found


def long_functions() -> dict[tuple[str, str], int]:
    return {(module, name): n for module, path in MODULES.items()
            for name, n in function_lines(path.read_text()).items()}


def test_no_file_over_the_line_limit():
    long = file_lines()
    stale = sorted(LONG_FILES - set(long))
    assert not stale, f"{stale} are {MAX_FILE_LINES} lines or fewer now: remove them from LONG_FILES"
    new = sorted(f"{module}: {n} lines" for module, n in long.items() if module not in LONG_FILES)
    assert not new, (f"modules over {MAX_FILE_LINES} lines (a guide, issue 37: a file may be long when it holds one "
                     f"idea): name each in LONG_FILES with the idea it holds, or split it by what it holds (each "
                     f"name then imported from its new home, no re-export):\n" + "\n".join(new))


def test_no_function_over_the_line_limit():
    long = long_functions()
    stale = sorted(LONG_FUNCTIONS - set(long))
    assert not stale, f"{stale} are {MAX_FUNCTION_LINES} lines or fewer now: remove them from LONG_FUNCTIONS"
    new = sorted(f"{module}.{name}: {n} lines" for (module, name), n in long.items() if (module, name) not in LONG_FUNCTIONS)
    assert not new, (f"functions over {MAX_FUNCTION_LINES} lines (a guide, issue 37): name each in LONG_FUNCTIONS with "
                     f"why it is one step, or split it into steps that say what they do:\n" + "\n".join(new))


def test_the_size_rules_count_what_they_say():
    short = "def f():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES - 1)
    long = "class C:\n    def g(self):\n" + "        x = 1\n" * MAX_FUNCTION_LINES
    nested = "def outer():\n    def inner():\n" + "        x = 1\n" * MAX_FUNCTION_LINES + "    return inner\n"
    assert function_lines(short) == {}
    assert function_lines(long) == {"C.g": MAX_FUNCTION_LINES + 1}
    assert function_lines(nested) == {"outer": MAX_FUNCTION_LINES + 3, "outer.inner": MAX_FUNCTION_LINES + 1}


if __name__ == "__main__":
    g = import_graph()
    print(f"{g.number_of_nodes()} modules, {g.number_of_edges()} import edges")
    for c in sorted(nx.simple_cycles(g), key=len):
        known = any((a, b) in KNOWN_CYCLE_EDGES for a, b in zip(c, c[1:] + c[:1]))
        print(("known: " if known else "CYCLE: ") + _describe(g, c))
    g.remove_edges_from(KNOWN_CYCLE_EDGES)
    print("cycles besides the known ones:", sorted(nx.simple_cycles(g), key=len))


# ----------------------------------------------------------------------------- phases (issue 29 part 4)
# The package's phases, in the order they may import one another: a module imports modules of
# its own phase or of an earlier one, never a later one; "sim" and "runtime" are siblings (the
# simulator does not run the runtime, the runtime does not consult the simulator). The compile
# front (api, compiler, options, the CLI) is last: it wires the phases together.
PHASE_ORDER = ("base", "trace", "topology", "planning", "sim|runtime", "passes", "front")
TOP_LEVEL_PHASES = {  # modules directly in mobius_fx/, by phase; a new one must be placed here
    "base": {"mobius_fx", "errors", "units", "kinds", "precision", "losses"},
    "trace": {"tracing", "trace_semantics", "export_front", "grad_modes", "module_paths", "trace_key", "trace_store"},
    "front": {"api", "compiler", "options", "__main__", "build", "pass_adapters", "train_step", "trainer",
              "compile_cache", "count_choice"},
}
KNOWN_PHASE_EDGES: dict[tuple[str, str], str] = {  # (importer, imported) -> why
    ("mobius_fx.passes.partition", "mobius_fx.options"):
        "the partition pass reads the compile settings it is run with (CompileContext; a type-only import)",
}


SUBPACKAGE_PHASES = {  # subpackages named for what they hold rather than for their phase
    "schedules": "sim",  # the schedules the simulator runs, one module each
    "zoo": "front",  # the models the CLI, the benchmarks, the examples and the tests build
}


def phase_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 2 and (ROOT / "mobius_fx" / parts[1]).is_dir() or parts[1:2] == ["passes"]:
        sub = SUBPACKAGE_PHASES.get(parts[1], parts[1])
        for ph in PHASE_ORDER:
            if sub in ph.split("|"):
                return sub
        raise AssertionError(f"{module}: subpackage {sub!r} has no phase; add it to PHASE_ORDER")
    leaf = parts[1] if len(parts) > 1 else "mobius_fx"
    for ph, names in TOP_LEVEL_PHASES.items():
        if leaf in names:
            return ph
    raise AssertionError(f"{module}: a top-level module with no phase; add it to TOP_LEVEL_PHASES")


def _rank(phase: str) -> int:
    return next(i for i, ph in enumerate(PHASE_ORDER) if phase in ph.split("|"))


def phase_violations() -> dict[tuple[str, str], list[int]]:
    graph = import_graph()
    out = {}
    for a, b in graph.edges:
        pa, pb = phase_of(a), phase_of(b)
        if pa == pb:
            continue
        if _rank(pb) > _rank(pa) or (_rank(pb) == _rank(pa)):  # a later phase, or a sibling
            out[(a, b)] = graph.edges[a, b]["lines"]
    return out


def test_each_phase_imports_only_earlier_phases():
    found = phase_violations()
    new = {k: v for k, v in found.items() if k not in KNOWN_PHASE_EDGES}
    stale = [k for k in KNOWN_PHASE_EDGES if k not in found]
    assert not new, "imports against the phase order " + " < ".join(PHASE_ORDER) + ":\n" + "\n".join(
        f"  {a} ({phase_of(a)}, line {lines[0]}) imports {b} ({phase_of(b)})" for (a, b), lines in sorted(new.items()))
    assert not stale, f"KNOWN_PHASE_EDGES names imports that are gone: {stale}"


def test_every_module_has_a_phase():
    for m in MODULES:
        phase_of(m)


# ----------------------------------------------------------------------------- benchmarks and examples (issue 29 part 4)
SCRIPT_FOLDERS = ("benchmarks", "examples")  # scripts run from a checkout; they may use the package, not the tests


def _names_a_tests_folder(node: ast.AST) -> bool:
    """Whether a string in `node` is a path with a `tests` component ("tests", "../tests", "tests/unit")."""
    return any(isinstance(c, ast.Constant) and isinstance(c.value, str)
               and "tests" in c.value.replace("\\", "/").split("/") for c in ast.walk(node))


def reaches_tests(source: str) -> list[tuple[int, str]]:
    """(line, what) for each way `source` reaches the tests: an import of `tests` or `tests.*`
    (at module level or inside a function), or a `sys.path.insert/append` of a path naming a
    `tests` folder (after which a test module imports under its bare name)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] == "tests"]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "tests":
            found.append((node.lineno, f"from {node.module} import ..."))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("insert", "append", "extend") and ast.unparse(node.func.value) == "sys.path"
              and any(_names_a_tests_folder(a) for a in node.args)):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_benchmarks_and_examples_do_not_import_the_tests():
    found = [f"{path.relative_to(ROOT)}:{line}: {what}"
             for folder in SCRIPT_FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))
             for line, what in reaches_tests(path.read_text())]
    assert not found, ("benchmarks and examples import only the package (a model they need goes in mobius_fx/zoo/, "
                       "which the tests import too):\n" + "\n".join(found))


def test_the_tests_import_rule_sees_each_way_in():
    assert reaches_tests("import mobius_fx\nfrom mobius_fx.zoo import nanogpt\nimport testsuite\n"
                         "sys.path.insert(0, ROOT)\nsys.path.insert(0, str(ROOT / 'benchmarks'))\n") == []
    assert [line for line, _ in reaches_tests(
        "from tests.models import gpt\n"
        "import tests.unit.test_books\n"
        "def f():\n    import tests\n"
        "sys.path.insert(0, str(Path(__file__).parents[1] / 'tests'))\n"
        "sys.path.append(os.path.join(HERE, '..', 'tests', 'unit'))\n"
        "sys.path.insert(0, '../tests')\n")] == [1, 2, 4, 5, 6, 7]


# ----------------------------------------------------------------------------- one file per device kind (issue 29 part 4)
# The classes every device kind builds on, shared by several kinds: module -> class.
DEVICE_BASES = {"mobius_fx.runtime.device_books": "Device", "mobius_fx.runtime.device_stream": "StreamDevice"}


def device_module(kind: str) -> str:
    """The module that holds device kind `kind` (`kinds.DEVICES`): "virtual-async" -> device_virtual_async."""
    return f"mobius_fx.runtime.device_{kind.replace('-', '_')}"


def device_classes() -> dict[str, list[str]]:
    """module -> the classes it defines that derive (directly, by name) from a class named *Device."""
    out: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                if any(b.endswith("Device") for b in bases):
                    out.setdefault(module, []).append(node.name)
    return out


def device_rule_problems(device_kinds: tuple[str, ...], classes: dict[str, list[str]]) -> list[str]:
    problems = []
    for kind in device_kinds:
        if kind == "auto":  # picks one of the others
            continue
        found = classes.get(device_module(kind), [])
        if len(found) != 1:
            problems.append(f"device kind {kind!r}: {device_module(kind)} defines {found or 'no'} Device classes, "
                            f"want exactly one")
    owners = {device_module(k) for k in device_kinds} | set(DEVICE_BASES)
    for module, names in classes.items():
        if module not in owners:
            problems.append(f"{module} defines device classes {names}: each kind lives in its own "
                            f"runtime/device_<kind>.py, named in kinds.DEVICES")
    return problems


def test_one_module_per_device_kind():
    from mobius_fx.kinds import DEVICES
    problems = device_rule_problems(DEVICES, device_classes())
    assert not problems, "\n".join(problems)


def test_the_device_rule_sees_a_missing_or_stray_kind():
    classes = device_classes()
    kinds = ("auto", "virtual", "virtual-async", "cuda")
    assert device_rule_problems(kinds, classes) == []
    assert device_rule_problems(kinds + ("tpu",), classes) == [
        "device kind 'tpu': mobius_fx.runtime.device_tpu defines no Device classes, want exactly one"]
    unlisted = device_rule_problems(("virtual", "cuda"), classes)  # a kind's module not in kinds.DEVICES
    assert [p.split()[0] for p in unlisted] == ["mobius_fx.runtime.device_virtual_async"]
    stray = dict(classes, **{"mobius_fx.runtime.devices": ["TpuDevice"]})
    assert [p.split()[0] for p in device_rule_problems(kinds, stray)] == ["mobius_fx.runtime.devices"]
    two = dict(classes, **{"mobius_fx.runtime.device_cuda": ["CudaDevice", "CudaGraphDevice"]})
    assert device_rule_problems(kinds, two)[0].startswith("device kind 'cuda'")


# ----------------------------------------------------------------------------- one meaning of "stage" (issue 29 part 4)
STAGING = re.compile(r"stag(ed|ing)", re.IGNORECASE)  # the verb: a name saying "stage" as something else
# Exceptions: (module, name) -> why it stays.
KNOWN_STAGING_NAMES: dict[tuple[str, str], str] = {
    ("mobius_fx.sim.arguments", "staging"): "the host-copy kind's old name, read only to say it is now 'pin'",
}


def names_in(source: str) -> list[tuple[int, str]]:
    """(line, name) for every name `source` gives or uses: identifiers, attributes, arguments,
    keywords, imported names, and string constants that look like a key (no spaces)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.keyword):
            names = [node.arg] if node.arg else []
        elif isinstance(node, ast.alias):
            names = [node.asname or node.name]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if re.fullmatch(r"[\w/.:-]+", node.value) else []
        else:
            names = []
        found += [(node.lineno, n) for n in names]
    return found


def staging_names() -> dict[tuple[str, str], list[int]]:
    out: dict[tuple[str, str], list[int]] = {}
    for module, path in MODULES.items():
        for line, name in names_in(path.read_text()):
            if STAGING.search(name):
                out.setdefault((module, name), []).append(line)
    return out


def test_stage_names_mean_a_pipeline_stage():
    found = staging_names()
    new = sorted(f"{m} line {min(lines)}: {n!r}" for (m, n), lines in found.items() if (m, n) not in KNOWN_STAGING_NAMES)
    stale = sorted(k for k in KNOWN_STAGING_NAMES if k not in found)
    assert not new, ('"stage" names a pipeline stage only (docs/architecture.md, "Glossary"); say what these are '
                     '(a pinned copy: pin; a copy through host memory: relayed):\n' + "\n".join(new))
    assert not stale, f"renamed: remove {stale} from KNOWN_STAGING_NAMES"


def test_the_stage_name_rule_sees_each_kind_of_name():
    src = ("staged = 1\nx.staging_buffer\ndef forget_staged(staging_bytes, *, n=0): pass\nf(staged_bytes=1)\n"
           "from m import staged_copy\nd = {'staging': 1}\nr = f'{gpu}/staging'\n"
           "stage = stages = StageIO = stage_peaks = 1\ns = 'the staging before uploads'\n")
    assert sorted({line for line, n in names_in(src) if STAGING.search(n)}) == [1, 2, 3, 4, 5, 6, 7]


# ----------------------------------------------------------------------------- a built pipeline is complete (issue 37 part 5)
# `build_pipeline` returns the Pipeline complete: no module but the runtime's and build.py reaches
# into a Pipeline's or a Runtime's private attributes, to set them or to read what it then changes.
PIPELINE_CLASSES = {"mobius_fx.runtime.pipeline": {"Pipeline"}, "mobius_fx.runtime.variants": {"VariantPipeline"},
                    "mobius_fx.runtime.engine": {"Runtime"}}
MAY_SET_PIPELINE_INTERNALS = ("mobius_fx.runtime", "mobius_fx.build")


def pipeline_private_names() -> set[str]:
    """The private attributes the Pipeline and Runtime classes keep (set on `self`, directly or
    by `object.__setattr__(self, "_x", ...)`, or declared in the class body)."""
    names = set()
    for module, classes in PIPELINE_CLASSES.items():
        for cls in (c for c in parsed(MODULES[module]).body if isinstance(c, ast.ClassDef) and c.name in classes):
            for n in ast.walk(cls):
                if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                        and n.value.id == "self"):
                    names.add(n.attr)
                elif (isinstance(n, ast.Call) and ast.unparse(n.func) == "object.__setattr__" and len(n.args) > 1
                      and isinstance(n.args[1], ast.Constant)):
                    names.add(n.args[1].value)
                elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                    names.add(n.target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def internals_reached(source: str, private: set[str]) -> list[str]:
    """'line N: code' for each reach into another object's internals in `source`: an attribute
    in `private` of anything but `self` (read or set: `pipe._rt.reducer = r`), `getattr` /
    `setattr` / `delattr` of one by name, and `object.__setattr__` on anything but `self`."""
    found = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Attribute) and n.attr in private and not (isinstance(n.value, ast.Name)
                                                                        and n.value.id == "self"):
            found.append(f"line {n.lineno}: {ast.unparse(n)}")
        elif isinstance(n, ast.Call):
            fn = ast.unparse(n.func)
            name = n.args[1].value if len(n.args) > 1 and isinstance(n.args[1], ast.Constant) else None
            if fn in ("getattr", "setattr", "delattr") and name in private:
                found.append(f"line {n.lineno}: {fn}(..., {name!r})")
            elif fn == "object.__setattr__" and not (n.args and isinstance(n.args[0], ast.Name) and n.args[0].id == "self"):
                found.append(f"line {n.lineno}: {ast.unparse(n)[:80]}")
    return found


def test_only_the_runtime_and_build_set_a_pipelines_internals():
    private = pipeline_private_names()
    assert {"_rt", "_step", "_variants", "_recompiler"} <= private, sorted(private)
    found = [f"{module} {hit}" for module, path in MODULES.items() if not module.startswith(MAY_SET_PIPELINE_INTERNALS)
             for hit in internals_reached(path.read_text(), private)]
    assert not found, ("modules outside the runtime and build.py reach into a Pipeline's or Runtime's internals; "
                       "build_pipeline returns the Pipeline complete: give what it needs to build_pipeline (its "
                       "`wiring`, build.Wiring) or add a public method:\n" + "\n".join(found))


def test_the_internals_rule_sees_each_way_in():
    private = {"_rt", "_step", "_variants"}
    assert internals_reached("pipe._rt.reducer = r", private) == ["line 1: pipe._rt"]
    assert internals_reached("object.__setattr__(pipe, 'max_variants', 3)", private)
    assert internals_reached("getattr(pipe, '_variants')[0].layers = ()", private)
    assert internals_reached("setattr(pipe, '_step', s)", private)
    assert not internals_reached("self._rt = rt\nobject.__setattr__(self, '_step', s)\npipe.train_step(x)", private)


# ----------------------------------------------------------------------------- runtime inputs are typed (issue 37 part 5)
# No parameter of a runtime function is annotated `Any`: the contract's classes (StageSpec,
# Schedule), Device, Precision, torch's types, or `object` for a value the function may not
# assume anything of (a user's argument, an opaque token). Exceptions, named with the reason:
KNOWN_ANY_PARAMETERS: dict[tuple[str, str], str] = {  # (module, "function(parameter)") -> why
    ("mobius_fx.runtime.executor", "StepExecutor.__init__(pipe)"):
        "the step Pipeline, whose module runs the executor (Pipeline._forward): a type import would be a cycle",
    ("mobius_fx.runtime.executor", "execute(pipe)"):
        "the step Pipeline, whose module runs the executor (Pipeline._forward): a type import would be a cycle",
    ("mobius_fx.runtime.executor", "step_ir(pipe)"):
        "the step Pipeline, whose module runs the executor (Pipeline._forward): a type import would be a cycle",
    ("mobius_fx.runtime.executor", "built_step(pipe)"):
        "the step Pipeline, whose module runs the executor (Pipeline._forward): a type import would be a cycle",
    ("mobius_fx.runtime.executor", "_form(pipe)"):
        "the step Pipeline, whose module runs the executor (Pipeline._forward): a type import would be a cycle",
    ("mobius_fx.runtime.step_code", "step_code(pipe)"):
        "the step Pipeline, built by build.py, which imports this module to print it: the pipeline module "
        "imports the executor, which this one reads",
    ("mobius_fx.runtime.step_program", "run_program(ex)"):
        "the StepExecutor, whose module imports this one (StepExecutor.run runs the program): a type import "
        "would be a cycle",
    ("mobius_fx.runtime.step_program", "_Run.__init__(ex)"):
        "the StepExecutor, whose module imports this one (StepExecutor.run runs the program): a type import "
        "would be a cycle",
    ("mobius_fx.runtime.step_output", "step_output(ex)"):
        "the StepExecutor, whose module imports this one: a type import would be a cycle",
    ("mobius_fx.runtime.microbatch_outputs", "prepare(runtime)"):
        "the Runtime, whose module (engine) imports this one: a type import would be a cycle",
    ("mobius_fx.runtime.overlap", "_checked(pipeline)"):
        "the Pipeline, whose module imports this one (pipe.overlap): a type import would be a cycle",
    ("mobius_fx.runtime.overlap", "OverlapOptimizer.__init__(pipeline)"):
        "the Pipeline, whose module imports this one (pipe.overlap): a type import would be a cycle",
    ("mobius_fx.runtime.stage_autograd", "Masters.forward(rt)"):
        "the Runtime, whose module imports this one: a type import would be a cycle",
    ("mobius_fx.runtime.stage_state", "StageCall.__init__(rt)"):
        "the Runtime, whose module imports this one: a type import would be a cycle",
}
# Modules another change of issue 37 rewrites now (module -> why): their parameters are typed there.
KNOWN_ANY_MODULES: dict[str, str] = {
    "mobius_fx.runtime.device_books": "the device interface (issue 37 part 5, bullet 1): tokens, events, saved inputs",
    "mobius_fx.runtime.device_stream": "the device interface (issue 37 part 5, bullet 1): streams and events",
    "mobius_fx.runtime.device_virtual_async": "the device interface (issue 37 part 5, bullet 1): streams and events",
    "mobius_fx.runtime.memory_sources": "the device interface (issue 37 part 5, bullet 1): the Device it books for",
}


def any_parameters(source: str) -> list[str]:
    """'function(parameter)' (methods and nested functions qualified) for every parameter of
    `source` whose annotation mentions `Any` (`*args` and `**kwargs` included)."""
    found = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                for arg in (*a.posonlyargs, *a.args, a.vararg, *a.kwonlyargs, a.kwarg):
                    if arg is not None and arg.annotation is not None and any(
                            isinstance(n, ast.Name) and n.id == "Any" or isinstance(n, ast.Attribute) and n.attr == "Any"
                            for n in ast.walk(arg.annotation)):
                        found.append(f"{prefix}{child.name}({arg.arg})")
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return found


def test_no_runtime_parameter_is_typed_any():
    runtime = {m: p for m, p in MODULES.items() if m.startswith("mobius_fx.runtime.")}
    found = {(m, f): None for m, p in runtime.items() if m not in KNOWN_ANY_MODULES for f in any_parameters(p.read_text())}
    stale = sorted(set(KNOWN_ANY_PARAMETERS) - set(found))
    assert not stale, f"{stale} are typed now: remove them from KNOWN_ANY_PARAMETERS"
    stale_modules = sorted(m for m in KNOWN_ANY_MODULES if not any_parameters(runtime[m].read_text()))
    assert not stale_modules, f"{stale_modules} have no `Any` parameter now: remove them from KNOWN_ANY_MODULES"
    new = sorted(f"{m}.{f}" for (m, f) in found if (m, f) not in KNOWN_ANY_PARAMETERS)
    assert not new, ("runtime parameters typed `Any`; give the real type (the contract's StageSpec / Schedule, Device, "
                     "Precision, torch's types), or `object` for a value the function may not assume anything of:\n"
                     + "\n".join(new))


def test_the_any_rule_sees_every_parameter():
    src = ("from typing import Any\nimport typing\n"
           "def f(a: Any, b: int, *c: Any, d: typing.Any = 1, **e: list[Any]): pass\n"
           "class C:\n    def m(self, x: object, y: Any | None):\n        def inner(z: Any): pass\n")
    assert any_parameters(src) == ["f(a)", "f(c)", "f(d)", "f(e)", "C.m(y)", "C.m.inner(z)"]
