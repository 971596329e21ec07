"""The package's import graph: no cycles, and no module imports a module above its layer.

The layers are the ones drawn in docs/design.md; a new module must be placed in one here. An
import counts wherever it is written (module level or inside a function), except under
``if TYPE_CHECKING:``: annotations may name anything (a lease names its store's protocol, the
store returns leases), since they never run.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import celery_lease

#: Lowest first. A module may import modules of its own layer or below, never above.
LAYERS: list[tuple[str, set[str]]] = [
    (
        "foundation",
        {
            "_clock",
            "_pid",
            "_errors",
            "_failpoints",
            "_interrupt",
            "_lanes",
            "metrics",
            "stores._bounds",
            "stores._connections",
            "stores.redis.scripts",
            "stores.sql.statements",
            "stores.sql.ledger_statements",
            "stores.sql.wait_statements",
        },
    ),
    ("rules", {"_names", "_codec", "_events", "_outage"}),
    ("settings", {"_settings", "_template", "_eventlog"}),
    ("core", {"_ledger", "_lease", "_renewer"}),
    (
        "store contract",
        {"stores.base", "stores.protocol", "stores.records", "stores._checks"},
    ),
    (
        "store backends",
        {
            "stores.memory",
            "stores.memory.core",
            "stores.memory.gates",
            "stores.memory.ledger",
            "stores.memory.store",
            "stores.memory.upkeep",
            "stores.memory.waits",
            "stores.redis",
            "stores.redis.connection",
            "stores.redis.core",
            "stores.redis.gates",
            "stores.redis.ledger",
            "stores.redis.store",
            "stores.redis.upkeep",
            "stores.redis.waits",
            "stores.sql",
            "stores.sql.connection",
            "stores.sql.rows",
            "stores.sql.schema",
            "stores.sql.ledger",
            "stores.sql.waits",
            "stores.sql.core",
            "stores.sql.gates",
            "stores.sql.identity",
            "stores.sql.store",
            "stores.sql.upkeep",
            "stores.sql.wait_lists",
        },
    ),
    ("store factory", {"stores", "stores.urls"}),
    (
        "celery wiring",
        {
            "_app",
            "_app_stores",
            "_passes",
            "_wakes",
            "_wake_queues",
            "_workerlog",
            "fencing",
            "_fence_args",
            "_fence_client",
            "_fence_redis",
            "_fence_sql",
        },
    ),
    # A lease task's rooms, each deciding one thing (see the _task docstring), lowest first.
    ("task parts", {"_gates", "_message", "_setup"}),
    ("task execution", {"_execution", "_unique"}),
    ("task copies", {"_copies"}),
    ("task outcomes", {"_waiting", "_outcomes"}),
    ("task attempt", {"_attempt"}),
    ("tasks", {"_task", "_sweeper", "_release", "_routes"}),
    (
        "entry points",
        {
            "",
            "cli",
            "_cli_common",
            "_cli_inspect",
            "_cli_check",
            "_cli_manage",
            "testing",
            "contrib",
            "contrib.flower",
            "contrib._flower_page",
            "contrib._flower_task",
        },
    ),
]

#: Backends never import one another: each is a room of its own.
BACKENDS = ("stores.memory", "stores.redis", "stores.sql")


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` (under ``root``) by its name relative to the package."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root / package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING`` itself (not ``not TYPE_CHECKING``, nor
    ``TYPE_CHECKING or x``: those bodies run)."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return (
        isinstance(test, ast.Attribute)
        and test.attr == "TYPE_CHECKING"
        and isinstance(test.value, ast.Name)
        and test.value.id == "typing"
    )


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """The nodes in the body of ``if TYPE_CHECKING:`` (never its ``else``): they never run."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child))
    return skipped


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package modules it imports (relative names, '' for the package)."""
    modules = module_names(root, package)

    def relative(target: str) -> str | None:
        if target == package:
            return ""
        if target.startswith(package + "."):
            return target[len(package) + 1 :]
        return None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = _type_checking_nodes(tree)
        here = [package, *name.split(".")] if name else [package]
        if path.name != "__init__.py":
            here = here[:-1]  # a module's relative imports start from its package
        found: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                stem = ".".join([*base, *([node.module] if node.module else [])])
                for alias in node.names:  # every name: "from . import a, b" imports both
                    sub, mod = relative(f"{stem}.{alias.name}"), relative(stem)
                    if sub is not None and sub in modules:
                        found.add(sub)  # "from .x import y": y is a module
                    elif mod is not None and mod in modules:
                        found.add(mod)  # else x is
            elif isinstance(node, ast.Import):
                for alias in node.names:  # "import p.a, p.b" imports both
                    target = relative(alias.name)
                    if target is not None and target in modules:
                        found.add(target)
        found.discard(name)
        graph[name] = found
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def upward_imports(graph: dict[str, set[str]], layers: list[tuple[str, set[str]]]) -> list[str]:
    """Each import of a module above the importer's layer, as 'a -> b (layer -> layer)'."""
    rank = {module: i for i, (_, members) in enumerate(layers) for module in members}
    names = [name for name, _ in layers]
    return [
        f"{module or '<package>'} -> {target} ({names[rank[module]]} -> {names[rank[target]]})"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if rank[target] > rank[module]
    ]


def backend_crossings(graph: dict[str, set[str]]) -> list[str]:
    def backend(module: str) -> str | None:
        return next((b for b in BACKENDS if module == b or module.startswith(b + ".")), None)

    return [
        f"{module} -> {target}"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if backend(module) and backend(target) and backend(module) != backend(target)
    ]


#: The driver packages whose exceptions a backend's connection.py translates.
DRIVERS = ("redis", "sqlalchemy", "psycopg", "psycopg2", "sqlite3")

#: Driver exceptions caught outside a connection.py, each on purpose (docs/design.md says why).
DRIVER_CATCHES_ALLOWED = {
    # The DDL race with another process creating the tables (retried) or a role that may not
    # create them (LeaseConfigError naming init-schema): decided on the driver error itself.
    "stores.sql.schema: SQLAlchemyError",
    # CONFIG refused (managed Redis) is a health-check warning, not a store failure.
    "stores.redis.core: redis.ResponseError",
}


def driver_catches(module: str, text: str) -> list[str]:
    """Each ``except`` in ``text`` that names a driver's exception, as 'module: name'."""
    tree = ast.parse(text)
    driver_names: set[str] = set()  # local names bound to a driver module or its classes
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in DRIVERS:
                    driver_names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            from_driver = node.level == 0 and (node.module or "").split(".")[0] in DRIVERS
            for alias in node.names:  # (a driver module passed on: "from .connection import redis")
                if from_driver or alias.name in DRIVERS:
                    driver_names.add(alias.asname or alias.name)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            kinds = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
            for kind in kinds:
                root = kind
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in driver_names:
                    found.append(f"{module}: {ast.unparse(kind)}")
    return found


#: A URL's start (``"redis://"``) or a store scheme's word (``"sqlite"``, ``"postgresql+psycopg"``).
_SCHEME_LITERAL = re.compile(
    r"[a-z][a-z0-9+.\-]*://.*|(?:redis|rediss|unix|postgres|postgresql|sqlite|memory)(?:[+:].*)?",
    re.IGNORECASE | re.DOTALL,
)


def _scheme_literals(node: ast.AST) -> list[str]:
    """The string constants in ``node`` that look like a URL scheme or a URL's start."""
    return [
        c.value
        for c in ast.walk(node)
        if isinstance(c, ast.Constant)
        and isinstance(c.value, str)
        and _SCHEME_LITERAL.fullmatch(c.value)
    ]


def scheme_sniffs(module: str, text: str) -> list[str]:
    """Each place in ``text`` that tells URL schemes apart, as 'module:line'.

    That is ``x.startswith(...)`` / ``x.endswith(...)`` with a scheme-like literal, a
    comparison with a literal URL start (``"sqlite://"``), and a comparison of something
    named ``scheme`` with a scheme-like literal. (A store *kind*,
    ``store_kind(url) == "redis"``, is the factory's answer, not a scheme, and is fine.)
    """
    found = []
    for node in ast.walk(ast.parse(text)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")
            and any(_scheme_literals(arg) for arg in node.args)
        ):
            found.append(f"{module}:{node.lineno}")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            literals = [value for side in sides for value in _scheme_literals(side)]
            about_scheme = any("scheme" in ast.unparse(side).lower() for side in sides)
            if any("://" in v for v in literals) or (literals and about_scheme):
                found.append(f"{module}:{node.lineno}")
    return found


ROOT = Path(celery_lease.__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT, "celery_lease")


class TestLayout:
    def test_every_module_has_a_layer(self, graph):
        """A new module must be placed in a layer (here and in docs/design.md)."""
        placed = {module for _, members in LAYERS for module in members}
        assert set(graph) - placed == set()
        assert placed - set(graph) == set(), "a layer names a module that no longer exists"

    def test_no_import_cycle(self, graph):
        """No module imports, directly or through others, a module that imports it."""
        assert cycles(graph) == []

    def test_no_module_imports_a_layer_above_its_own(self, graph):
        """Stores never import the task layer, rules never import stores, and so on."""
        assert upward_imports(graph, LAYERS) == []

    def test_backends_do_not_import_each_other(self, graph):
        """Redis, SQL and memory stores share only the layers below them."""
        assert backend_crossings(graph) == []

    def test_only_the_store_factory_tells_url_schemes_apart(self):
        """No module but stores/urls.py checks a URL against a scheme (``startswith("redis://")``,
        ``startswith("sqlite")``, ``scheme == "postgresql"``): which scheme names which store is
        decided in one place."""
        sniffing = [
            sniff
            for name, path in module_names(ROOT, "celery_lease").items()
            if name != "stores.urls"
            for sniff in scheme_sniffs(name, path.read_text(encoding="utf-8"))
        ]
        assert sniffing == []

    def test_only_connection_modules_catch_driver_errors(self):
        """Driver exceptions are translated in each backend's connection.py; the few caught
        elsewhere are listed (DRIVER_CATCHES_ALLOWED) and explained in docs/design.md."""
        caught = [
            catch
            for name, path in module_names(ROOT, "celery_lease").items()
            if not name.endswith(".connection")
            for catch in driver_catches(name, path.read_text(encoding="utf-8"))
        ]
        assert set(caught) == DRIVER_CATCHES_ALLOWED

    def test_the_design_page_draws_the_same_layers(self):
        """docs/design.md names every layer of LAYERS, in the same order."""
        text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
        positions = [text.find(f"**{name}**") for name, _ in LAYERS]
        missing = [name for (name, _), p in zip(LAYERS, positions, strict=True) if p < 0]
        assert missing == []
        assert positions == sorted(positions, reverse=True)  # drawn top (highest) down


class TestTheCheckItself:
    """Negative controls: the checks above catch what they look for."""

    @staticmethod
    def _package(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
        for name, text in files.items():
            path = tmp_path / "pkg" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return import_graph(tmp_path, "pkg")

    def test_a_cycle_through_a_function_level_import_is_found(self, tmp_path):
        """A lazy import inside a function still closes a cycle."""
        graph = self._package(
            tmp_path,
            {
                "__init__.py": "",
                "a.py": "from . import b\n",
                "b.py": "def f():\n    from .a import x\n",
            },
        )
        assert cycles(graph) == [["a", "b"]]

    def test_a_type_checking_import_is_not_counted(self, tmp_path):
        """An import under TYPE_CHECKING never runs: no edge."""
        graph = self._package(
            tmp_path,
            {
                "__init__.py": "",
                "a.py": "from . import b\n",
                "b.py": (
                    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"
                ),
            },
        )
        assert cycles(graph) == []

    @pytest.mark.parametrize(
        "text",
        [
            "from . import low, high\n",  # the second name of one from-import
            "import pkg.low, pkg.high\n",  # the second module of one import
            "from typing import TYPE_CHECKING\nif not TYPE_CHECKING:\n    from . import high\n",
            "import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    from . import high\n",
        ],
        ids=["second-alias", "second-import", "if-not-type-checking", "type-checking-else"],
    )
    def test_every_import_that_runs_is_found(self, tmp_path, text):
        """Each imported module counts, and only the body of ``if TYPE_CHECKING:`` is skipped."""
        graph = self._package(
            tmp_path, {"__init__.py": "", "low.py": "", "mid.py": text, "high.py": ""}
        )
        layers = [("bottom", {"low"}), ("middle", {"mid"}), ("top", {"", "high"})]
        assert upward_imports(graph, layers) == ["mid -> high (middle -> top)"]

    def test_typing_type_checking_is_skipped_too(self, tmp_path):
        """``if typing.TYPE_CHECKING:`` never runs either: no edge."""
        graph = self._package(
            tmp_path,
            {
                "__init__.py": "",
                "low.py": "import typing\nif typing.TYPE_CHECKING:\n    from . import high\n",
            }
            | {"high.py": ""},
        )
        assert graph["low"] == set()

    def test_a_driver_exception_caught_outside_connection_is_found(self):
        """``except`` naming a driver class, by module or by imported name, is reported."""
        text = (
            "import redis\nimport sqlalchemy as sa\nfrom psycopg import errors as pe\n"
            "from sqlalchemy.exc import DBAPIError\nfrom .connection import redis as r\n"
            "try:\n    pass\nexcept (redis.ConnectionError, KeyError):\n    pass\n"
            "except sa.exc.OperationalError:\n    pass\nexcept pe.Error:\n    pass\n"
            "except DBAPIError:\n    pass\nexcept r.ResponseError:\n    pass\n"
            "except OSError:\n    pass\n"
        )
        assert driver_catches("m", text) == [
            "m: redis.ConnectionError",
            "m: sa.exc.OperationalError",
            "m: pe.Error",
            "m: DBAPIError",
            "m: r.ResponseError",
        ]

    @pytest.mark.parametrize(
        "line",
        [
            'url.startswith("redis://")',
            'scheme.group(0).lower().startswith("sqlite")',
            'url.lower().startswith(("postgres", "postgresql+psycopg"))',
            'parsed.scheme == "rediss"',
            'url_scheme in ("memory", "unix")',
            'url[:9] == "sqlite://"',
        ],
    )
    def test_a_scheme_check_outside_the_factory_is_found(self, line):
        """Telling schemes apart by prefix or by comparison is reported."""
        assert scheme_sniffs("m", f"if {line}:\n    pass\n") == ["m:1"]

    def test_a_store_kind_comparison_is_not_a_scheme_check(self):
        """Comparing the factory's answer (the store kind) is how the rest should decide."""
        assert (
            scheme_sniffs("m", 'if store_kind(url) == "redis" or kind == "sqlite":\n    x\n') == []
        )

    def test_an_upward_import_is_found(self, tmp_path):
        """A low module importing a higher one is reported, with both layers."""
        graph = self._package(
            tmp_path,
            {"__init__.py": "", "low.py": "from .sub.high import x\n", "sub/__init__.py": ""}
            | {"sub/high.py": "from ..low import y\n"},
        )
        layers = [("bottom", {"low"}), ("top", {"", "sub", "sub.high"})]
        assert upward_imports(graph, layers) == ["low -> sub.high (bottom -> top)"]
