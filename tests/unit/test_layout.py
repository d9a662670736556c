"""The repository's layout, read with ``ast`` from the files alone (nothing is imported):

- floors, from the ground up: 0 ``config``, 1 ``parallelisms``, 2 ``models``, 3 ``trainer``,
  4 ``programs`` (pre-launch check, dry run, planner, launcher), 5 the entry points (train.py,
  bench/, scripts/). A module imports only project modules on its own floor or below, so nothing
  the ranks run imports a program;
- no import cycle among the project's modules;
- trainer/trainer.py stays under 350 lines, no product file (outside tests/, bench/, scripts/) is
  longer than 500 lines, and no function is longer than 60 lines;
- no config option is named under parallelisms/ (the techniques speak in their own parameters);
- no error message is written in two places.

Every import statement counts: at module level, inside functions, under ``if TYPE_CHECKING``.
The checkers take the repository root, so the tests at the bottom run them on small synthetic
trees to show that each one can fail."""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Top-level name -> floor. Imports of any other top-level name are third-party and ignored.
FLOORS = {
    "config": 0,
    "parallelisms": 1,
    "models": 2,
    "trainer": 3,
    "programs": 4,
    "train": 5,
    "bench": 5,
    "scripts": 5,
}
SKIPPED_DIRS = {"tests", "__pycache__"}  # and every directory starting with a dot (.venv, .git)
MAX_FUNCTION_LINES = 60
MAX_TRAINER_LINES = 350  # trainer/trainer.py has fewer lines than this


@dataclass(frozen=True)
class Import:
    line: int
    target: str  # the dotted module name, resolved to a project file where one exists


@dataclass(frozen=True)
class Module:
    name: str  # dotted: "trainer.trainer", "models.llama3" (a package), "train"
    path: str  # relative to the root, with forward slashes
    is_package: bool
    tree: ast.Module

    @property
    def top(self) -> str:
        return self.name.split(".")[0]


def source_files(root: Path) -> list[Path]:
    """Every non-test .py file under ``root``."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS)
        found += [Path(folder, f) for f in sorted(files) if f.endswith(".py") and not f.startswith("test_")]
    return found


def load_modules(root: Path) -> dict[str, Module]:
    modules = {}
    for file in source_files(root):
        relative = file.relative_to(root)
        parts = list(relative.with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        name = ".".join(parts)
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(relative))
        modules[name] = Module(name, relative.as_posix(), is_package, tree)
    return modules


def _existing(name: str, modules: dict[str, Module]) -> str:
    """``name`` or its longest prefix that is a module of the tree (``name`` itself when none is)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return name


def imports_of(module: Module, modules: dict[str, Module]) -> list[Import]:
    """The modules ``module`` imports anywhere in its file, relative imports resolved against its
    package, and ``from package import name`` resolved to ``package.name`` when that is a module."""
    found = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            found += [Import(node.lineno, _existing(alias.name, modules)) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
                if node.level - 1 > len(package) - 1:
                    continue  # beyond the top-level package: Python refuses it too
                base = ".".join(package[: len(package) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                target = submodule if submodule in modules else _existing(base, modules)
                found.append(Import(node.lineno, target))
    return sorted(set(found), key=lambda i: (i.line, i.target))


def floor_violations(root: Path) -> list[str]:
    """Imports of a project module on a higher floor than the importer, and files on no floor."""
    modules = load_modules(root)
    problems = []
    for module in modules.values():
        if module.top not in FLOORS:
            problems.append(f"{module.path}: top-level '{module.top}' has no floor (add it to FLOORS)")
            continue
        floor = FLOORS[module.top]
        for imp in imports_of(module, modules):
            top = imp.target.split(".")[0]
            if top in FLOORS and FLOORS[top] > floor:
                problems.append(
                    f"{module.path}:{imp.line} {module.name} (floor {floor}) imports {imp.target} (floor {FLOORS[top]})"
                )
    return sorted(problems)


def import_graph(root: Path) -> tuple[dict[str, Module], dict[str, dict[str, int]]]:
    """Project modules and their edges: importer -> {imported project module: first line}."""
    modules = load_modules(root)
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for module in modules.values():
        for imp in imports_of(module, modules):
            if imp.target in modules and imp.target != module.name:
                graph[module.name].setdefault(imp.target, imp.line)
    return modules, graph


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components in discovery order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def _cycle_through(start: str, members: set[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """A shortest path start -> ... -> start inside one strongly connected component."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node]):
                if successor not in members:
                    continue
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if successor not in parents:
                    parents[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def import_cycles(root: Path) -> list[str]:
    """One cycle per strongly connected component of the import graph, as
    ``a -> b -> a  (a.py:3 imports b; b.py:7 imports a)``."""
    modules, graph = import_graph(root)
    cycles = []
    for component in _strongly_connected(graph):
        if len(component) < 2:
            continue
        path = _cycle_through(component[0], set(component), graph)
        steps = [f"{modules[a].path}:{graph[a][b]} imports {b}" for a, b in zip(path, path[1:])]
        cycles.append(f"{' -> '.join(path)}  ({'; '.join(steps)})")
    return cycles


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions and methods longer than ``limit`` lines, from the ``def`` line to the last one
    (decorators excluded), as ``path:line name (N lines)``."""
    offenders = []
    for module in load_modules(root).values():
        for name, node in _functions(module.tree):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                offenders.append((module.path, node.lineno, f"{module.path}:{node.lineno} {name} ({length} lines)"))
    return [text for *_, text in sorted(offenders)]


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


MAX_FILE_LINES = 500
PRODUCT_EXCLUDED = {"bench", "scripts"}  # with tests/: measured, not shipped


def long_files(root: Path, limit: int = MAX_FILE_LINES) -> list[str]:
    """Product files (outside tests/, bench/, scripts/) longer than ``limit`` lines."""
    return [
        f"{module.path} ({count} lines)"
        for module in sorted(load_modules(root).values(), key=lambda m: m.path)
        if module.top not in PRODUCT_EXCLUDED and (count := line_count(root / module.path)) > limit
    ]


def config_option_names(root: Path) -> set[str]:
    """Every ``section.field`` of the config schema (config/job_config.py, read with ``ast``)."""
    tree = ast.parse((root / "config" / "job_config.py").read_text(encoding="utf-8"))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def fields(cls: ast.ClassDef) -> list[tuple[str, str]]:
        return [
            (node.target.id, ast.unparse(node.annotation))
            for node in cls.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        ]

    return {
        f"{section}.{name}"
        for section, type_name in fields(classes["JobConfig"])
        if type_name in classes
        for name, _ in fields(classes[type_name])
    }


def option_names_in(root: Path, folder: str) -> list[str]:
    """``path:line option`` for each config option named anywhere in ``folder``'s files (code,
    strings, comments): the techniques there speak in their own parameters."""
    options = config_option_names(root)
    pattern = re.compile(r"\b[a-z0-9_]+\.[a-z0-9_]+\b")
    found = []
    for module in sorted(load_modules(root).values(), key=lambda m: m.path):
        if module.top != folder:
            continue
        lines = (root / module.path).read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, 1):
            found += [f"{module.path}:{number} {name}" for name in pattern.findall(line) if name in options]
    return found


def _message_text(node: ast.expr) -> str | None:
    """The literal text of an error message: a string, or an f-string with ``{}`` for its values."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _message_text(node.left), _message_text(node.right)
        return None if left is None or right is None else left + right
    return None


def repeated_messages(root: Path, shortest: int = 30) -> list[str]:
    """Error messages (the first argument of an exception raised or built) of at least ``shortest``
    characters of literal text that are written in more than one place of the product code."""
    places: dict[str, list[str]] = {}
    for module in load_modules(root).values():
        if module.top in PRODUCT_EXCLUDED:
            continue
        for node in ast.walk(module.tree):
            if not (isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Name)):
                continue
            if not (node.func.id.endswith("Error") or node.func.id.endswith("Exception")):
                continue
            text = _message_text(node.args[0])
            if text is not None and len(text.replace("{}", "")) >= shortest:
                places.setdefault(text, []).append(f"{module.path}:{node.lineno}")
    return sorted(f"{text!r} at {', '.join(sorted(where))}" for text, where in places.items() if len(where) > 1)


# --- the repository -----------------------------------------------------------


def test_imports_go_down_the_floors():
    problems = floor_violations(REPO)
    assert not problems, "imports of a higher floor:\n" + "\n".join(problems)


def test_no_import_cycles():
    cycles = import_cycles(REPO)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_trainer_module_is_short():
    path = REPO / "trainer" / "trainer.py"
    assert path.is_file(), "trainer/trainer.py is missing"
    assert line_count(path) < MAX_TRAINER_LINES, f"trainer/trainer.py has {line_count(path)} lines"


def test_no_long_functions():
    offenders = long_functions(REPO)
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)


def test_no_long_files():
    offenders = long_files(REPO)
    assert not offenders, f"product files over {MAX_FILE_LINES} lines:\n" + "\n".join(offenders)


def test_no_option_names_under_parallelisms():
    found = option_names_in(REPO, "parallelisms")
    assert not found, "config options named under parallelisms/ (map the technique's errors in models/):\n" + "\n".join(
        found
    )


def test_no_error_message_is_written_twice():
    repeated = repeated_messages(REPO)
    assert not repeated, "error messages written in more than one place:\n" + "\n".join(repeated)


# --- the checkers fail where they should --------------------------------------


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def function_of(lines: int, name: str = "f", decorators: int = 0) -> str:
    """Source of a function spanning exactly ``lines`` lines from its ``def``."""
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 2))
    return "@staticmethod\n" * decorators + f"def {name}():\n{body}    return 0\n"


def test_upward_imports_are_reported_with_file_and_line(tmp_path):
    root = write_tree(
        tmp_path,
        {
            "config/__init__.py": "import os\nimport configparser\n",
            "config/job.py": "import torch\n\nfrom trainer.metrics import x\n",
            "parallelisms/__init__.py": "",
            "parallelisms/fsdp.py": "from config import job\nfrom . import tp\n\n\ndef f():\n    import models.llama\n",
            "parallelisms/tp.py": "",
            "models/__init__.py": "",
            "models/llama/__init__.py": "from .. import registry\nfrom ...trainer import y\n",
            "models/registry.py": "from parallelisms.tp import apply\nimport config.job\n",
            "trainer/__init__.py": "",
            "trainer/metrics.py": "from models import registry\nimport train\n",
            "train.py": "from trainer import metrics\n",
            "bench/run.py": "import sys\nsys.path.insert(0, '..')\nfrom trainer.metrics import x\nimport bench\n",
        },
    )
    assert floor_violations(root) == [
        "config/job.py:3 config.job (floor 0) imports trainer.metrics (floor 3)",
        "parallelisms/fsdp.py:6 parallelisms.fsdp (floor 1) imports models.llama (floor 2)",
        "trainer/metrics.py:2 trainer.metrics (floor 3) imports train (floor 5)",
    ]


def test_relative_imports_resolve_against_the_package(tmp_path):
    root = write_tree(
        tmp_path,
        {
            "models/__init__.py": "from .llama import model\n",
            "models/registry.py": "",
            "models/llama/__init__.py": "from . import model\nfrom .model import Net\nfrom .. import registry, other\n",
            "models/llama/model.py": "from ..registry import get\nfrom . import *\n",
        },
    )
    modules = load_modules(root)
    targets = {name: [i.target for i in imports_of(m, modules)] for name, m in modules.items()}
    assert targets == {
        "models": ["models.llama.model"],
        "models.registry": [],
        "models.llama": ["models.llama.model", "models.llama.model", "models", "models.registry"],
        "models.llama.model": ["models.registry", "models.llama"],
    }


def test_files_outside_the_floors_are_reported(tmp_path):
    root = write_tree(tmp_path, {"utils/helpers.py": "", "trainer/__init__.py": "", "tests/test_x.py": ""})
    assert floor_violations(root) == ["utils/helpers.py: top-level 'utils' has no floor (add it to FLOORS)"]


def test_missing_config_package_is_fine(tmp_path):
    root = write_tree(tmp_path, {"trainer/__init__.py": "from config import Job\n", "trainer/config.py": ""})
    assert floor_violations(root) == []
    assert import_cycles(root) == []


def test_cycles_are_reported_as_a_path(tmp_path):
    root = write_tree(
        tmp_path,
        {
            "trainer/__init__.py": "",
            "trainer/a.py": "from trainer import b\n",
            "trainer/b.py": "def f():\n    from trainer.c import g  # function-level imports count\n",
            "trainer/c.py": "import trainer.a\n",
            "trainer/d.py": "from trainer import a, b, c\n",  # into the cycle, not part of it
            "models/__init__.py": "from . import m\n",
            "models/m.py": "from models import thing\n",  # the package itself: models -> models.m -> models
        },
    )
    assert import_cycles(root) == [
        "models -> models.m -> models  (models/__init__.py:1 imports models.m; models/m.py:1 imports models)",
        "trainer.a -> trainer.b -> trainer.c -> trainer.a  (trainer/a.py:1 imports trainer.b; "
        "trainer/b.py:2 imports trainer.c; trainer/c.py:1 imports trainer.a)",
    ]


def test_no_cycles_in_a_layered_tree(tmp_path):
    root = write_tree(
        tmp_path,
        {
            "config/__init__.py": "",
            "trainer/__init__.py": "from trainer.t import T\n",
            "trainer/t.py": "import config\nfrom trainer import u\n",
            "trainer/u.py": "import config\n",
        },
    )
    assert import_cycles(root) == []


def test_long_functions_are_reported(tmp_path):
    source = "\n".join(
        [
            function_of(60, "fits"),
            function_of(61, "too_long"),
            function_of(60, "decorated", decorators=3),  # decorators do not count
            "class C:\n" + "".join("    " + line + "\n" for line in function_of(62, "method").splitlines()),
            "def outer():\n" + "".join("    " + line + "\n" for line in function_of(61, "inner").splitlines()),
        ]
    )
    root = write_tree(tmp_path, {"trainer/__init__.py": "", "trainer/t.py": source, "tests/test_t.py": source})
    assert long_functions(root) == [
        "trainer/t.py:62 too_long (61 lines)",
        "trainer/t.py:189 C.method (62 lines)",
        "trainer/t.py:252 outer (62 lines)",
        "trainer/t.py:253 outer.inner (61 lines)",
    ]


def test_line_count(tmp_path):
    path = tmp_path / "t.py"
    path.write_text("a = 1\n" * MAX_TRAINER_LINES)
    assert line_count(path) == MAX_TRAINER_LINES


def test_long_files_are_reported_outside_tests_bench_and_scripts(tmp_path):
    long = "x = 1\n" * (MAX_FILE_LINES + 1)
    root = write_tree(
        tmp_path,
        {
            "trainer/__init__.py": "",
            "trainer/fits.py": "x = 1\n" * MAX_FILE_LINES,
            "trainer/long.py": long,
            "bench/long.py": long,
            "scripts/long.py": long,
            "tests/test_long.py": long,
        },
    )
    assert long_files(root) == [f"trainer/long.py ({MAX_FILE_LINES + 1} lines)"]


SCHEMA = """
class Training:
    seq_len: int = 8

class Comm:
    alpha_us: float = 0.0

class JobConfig:
    training: Training
    comm: Comm
"""


def test_option_names_are_found_in_code_strings_and_comments(tmp_path):
    root = write_tree(
        tmp_path,
        {
            "config/job_config.py": SCHEMA,
            "parallelisms/tp.py": 'x = "training.seq_len"\n# comm.alpha_us\ny = seq_len.size  # os.path, training.steps\n',
            "models/m.py": 'z = "training.seq_len"\n',
        },
    )
    assert config_option_names(root) == {"training.seq_len", "comm.alpha_us"}
    assert option_names_in(root, "parallelisms") == [
        "parallelisms/tp.py:1 training.seq_len",
        "parallelisms/tp.py:2 comm.alpha_us",
    ]


def test_an_error_message_written_twice_is_reported(tmp_path):
    message = "checkpoint.folder: {path} is not a folder of checkpoints"
    root = write_tree(
        tmp_path,
        {
            "programs/check.py": f'def f(path):\n    raise ConfigError(f"{message}")\n',
            "trainer/manager.py": f'def g(path):\n    error = ValueError(f"{message}")\n    raise error\n',
            "trainer/other.py": 'def h():\n    raise ValueError("short")\n\n\ndef i():\n    raise ValueError("short")\n',
            "bench/b.py": f'raise ValueError(f"{message}")\n',
        },
    )
    assert repeated_messages(root) == [
        "'checkpoint.folder: {} is not a folder of checkpoints' at programs/check.py:2, trainer/manager.py:2"
    ]
