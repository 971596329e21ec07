"""The docs site builds with no warning, and every code block in the docs is run or checked.

What each kind of block goes through is described in tests/tooling/docblocks.py: python blocks
are executed (one namespace per page, in a pytest run of their own, against the in-memory
store of ``celery_lease.testing``, an eager app or SQLite in a scratch directory) or, when
marked ``<!-- test: typecheck, <why> -->``, type-checked with mypy against the public API.
The code examples in the package's docstrings (what the API reference shows) follow the same
rules, one namespace per docstring. ``celery -A proj lease|worker ...`` commands are checked
against the real command line.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from celery_lease._settings import SETTINGS_DOC, LeaseSettings
from tests.tooling import docblocks
from tests.tooling.docblocks import Page

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
PARSED = {path.name: docblocks.parse(path) for path in PAGES}
RUN = [page for page in PARSED.values() if page.of("exec")]
CHECKED = [page for page in PARSED.values() if page.of("typecheck")]
#: One page per docstring with python blocks, and the examples nothing would run or check.
DOCSTRINGS, DOCSTRING_PROBLEMS = docblocks.docstrings(ROOT / "celery_lease", ROOT)
DOC_RUN = [page for page in DOCSTRINGS if page.of("exec")]
DOC_CHECKED = [page for page in DOCSTRINGS if page.of("typecheck")]
#: The app the command lines are checked with: its lease task installs the --lease-* options.
CLI_APP = "tests.user_suite.myapp"


def _env(*paths: Path) -> dict[str, str]:
    # The scratch directories are outside the checkout: make the checkout's celery_lease win
    # over whatever an installed (or editable) copy points at.
    path = os.pathsep.join(str(p) for p in (*paths, ROOT))
    return {**os.environ, "PYTHONPATH": path, "NO_MKDOCS_2_WARNING": "1"}


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "lease_task" in api  # the reference is generated from the docstrings
    assert "paused_renewals" in api
    # Hidden setup code stays an HTML comment: nobody sees it on the page.
    page = (tmp_path / "site" / "exactly-once" / "index.html").read_text()
    assert "FakeStripe" in page
    assert "FakeStripe" not in re.sub(r"<!--.*?-->", "", page, flags=re.S)
    assert (
        'class="filename">proj.py'
        in (tmp_path / "site" / "getting-started" / "index.html").read_text()
    )
    # The docstrings' examples are highlighted code, their markers invisible, no RST left over.
    shown = re.sub(r"<!--.*?-->", "", api, flags=re.S)
    assert "test: typecheck" in api
    assert "test: typecheck" not in shown
    assert not re.search(r"::\s*</p>", shown)
    assert re.search(r"language-python.*?drive_browser", api, flags=re.S)


def test_every_public_name_is_in_the_api_reference() -> None:
    import celery_lease

    api = (ROOT / "docs" / "api.md").read_text()
    assert "::: celery_lease.testing\n" in api  # the module page lists its own __all__
    missing = [
        name
        for name in celery_lease.__all__
        if name != "__version__"
        and f"::: celery_lease.{name}\n" not in api
        and f"::: celery_lease.stores.{name}\n" not in api
        and f"`celery_lease.{name}`" not in api
    ]
    assert missing == []


def test_every_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [p.name for p in PAGES if p.parent == ROOT / "docs" and p.name not in nav]
    assert missing == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_python_block_is_executed_or_type_checked(page: Path) -> None:
    """No block is skipped: each ```python fence is parsed and placed, and is valid Python."""
    text = page.read_text()
    parsed = PARSED[page.name]
    python = [b for b in parsed.blocks if b.lang == "python" and b.mode != "setup"]
    assert len(python) == text.count("\n```python") + text.startswith("```python")
    for block in python:
        assert block.mode in {"exec", "typecheck"}, block.where
        assert block.mode == "exec" or block.reason, f"{block.where}: say why it is not run"
    _assert_parses(parsed.of("exec", "typecheck", "setup"))


def _assert_parses(blocks: Iterable[Any]) -> None:
    """Every block is valid Python; a syntax error names the block's file:line."""
    for block in blocks:
        try:
            ast.parse(block.code)
        except SyntaxError as exc:
            pytest.fail(f"{block.where} (+{exc.lineno}): {exc.msg}")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("<!-- test: skip -->\n```python\nx = 1\n```\n", "marker 'skip'"),
        ("<!-- test: typecheck -->\n```python\nx = 1\n```\n", "a reason is required"),
        ("```py\nx = 1\n```\n", "fence language 'py'"),
        ("- item\n\n    ```python\n    x = 1\n    ```\n", "indented fence"),
        ("<!-- test: typecheck, needs Redis -->\n\ntext\n```python\nx = 1\n```\n", "precede"),
    ],
)
def test_a_block_the_tests_cannot_place_fails(tmp_path: Path, text: str, error: str) -> None:
    """Negative control for the rule above: no python block can slip past unrun."""
    page = tmp_path / "page.md"
    page.write_text(text)
    with pytest.raises(docblocks.DocsError, match=re.escape(error)):
        docblocks.parse(page)


# Docstrings ------------------------------------------------------------------------------


def test_every_docstring_example_is_executed_or_type_checked() -> None:
    """Each code example in a docstring is a python block that runs or is type-checked (with a
    reason); a ``::`` literal block, a doctest or an indented block fails here with file:line."""
    assert DOCSTRING_PROBLEMS == []
    labels = {page.label for page in DOCSTRINGS}
    # The examples the API reference shows were found (the scan does not silently see none).
    assert {"celery_lease._task.lease_task", "celery_lease.fencing.FenceGate"} <= labels
    for page in DOCSTRINGS:
        blocks = page.of("exec", "typecheck", "setup")
        for block in blocks:
            assert block.mode != "typecheck" or block.reason, block.where
        _assert_parses(blocks)


@pytest.mark.parametrize(
    ("docstring", "error"),
    [
        ("Example::\n\n    x = 1\n", "m.py:2: a literal block (::)"),
        ("Use it:\n\n>>> x = 1\n", "m.py:4: a doctest (>>>)"),
        ("Use it:\n\n    x = 1\n\nDone.\n", "m.py:4: an indented block shows as code"),
        ("Examples:\n    x = 1\nDone.\n", "m.py:2: an Examples: section is not checked"),
        (
            "Args:\n    x: one\n\n    ```python\n    x = 1\n    ```\nDone.\n",
            "m.py:5: indented fence",
        ),
        ("<!-- test: typecheck -->\n```python\nx = 1\n```\n", "m.py:2: marker 'typecheck'"),
        ("Use it:\n\n```py\nx = 1\n```\n", "m.py:4: fence language 'py'"),
        ("A\\nB\n```python\nx = 1\n```\n", "m.py:2: escape sequences"),
    ],
)
def test_a_docstring_example_the_tests_cannot_place_fails(
    tmp_path: Path, docstring: str, error: str
) -> None:
    """Negative control: the scan names the file and line of each kind of unchecked example."""
    package = tmp_path / "pkg"
    package.mkdir()
    # The docstring starts on line 2: the reported lines are the file's. (Like inspect.cleandoc,
    # the scan takes the indentation common to the lines after the first as the margin.)
    (package / "m.py").write_text(f'\n"""{docstring}"""\n')
    _, problems = docblocks.docstrings(package, tmp_path)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"pkg/{error}"), problems[0]


def test_a_checked_docstring_example_is_found_where_it_stands(tmp_path: Path) -> None:
    """The positive side: a python block in a method's docstring is a page of its own,
    executed, at its line in the file."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text(
        'class C:\n    def f(self):\n        """Do it:\n\n        ```python\n        x = 1\n'
        '        ```\n        """\n'
    )
    pages, problems = docblocks.docstrings(package, tmp_path)
    assert problems == []
    assert [(p.label, [(b.where, b.mode) for b in p.blocks]) for p in pages] == [
        ("pkg.m.C.f", [("pkg/m.py:6", "exec")])
    ]


# Executed blocks -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """Start the pages' pytest runs at once and collect them on demand. A page that writes files
    of its own (``proj.py``) runs alone; the others share one run, each page a module."""
    base = tmp_path_factory.mktemp("pages")
    groups: dict[Path, list[tuple[Page, list[int]]]] = {}
    for page in RUN:
        into = base / (page.slug if page.has_files else "shared")
        groups.setdefault(into, []).append((page, docblocks.write_page_program(page, into)))
    # The docstrings' examples share one run of their own (titled files such as the testing
    # module's conftest.py first, before a page would write the default one).
    for page in sorted(DOC_RUN, key=lambda p: not p.has_files):
        into = base / "docstrings"
        groups.setdefault(into, []).append((page, docblocks.write_page_program(page, into)))
    runs: dict[str, object] = {}
    processes = []
    for into, pages in groups.items():
        process = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "pytest_timeout", "."],
            cwd=into,
            # Only the plugins a page needs (its conftest names celery_lease.testing): loading
            # every installed one (hypothesis, pytest-celery) costs seconds per run.
            env={**_env(into), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        processes.append(process)
        outcome: dict[str, object] = {}
        for page, expected in pages:
            runs[page.slug] = (process, outcome, into / f"ran_{page.slug}.json", expected)
    yield runs
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.communicate()


@pytest.mark.parametrize("page", RUN + DOC_RUN, ids=lambda p: p.label)
def test_the_page_runs(page: Page, page_runs: dict[str, object]) -> None:
    """The page's (or docstring's) executed blocks run in order, and the tests they define
    pass."""
    process, outcome, ran, expected = page_runs[page.slug]  # type: ignore[misc]
    if "output" not in outcome:
        outcome["output"] = process.communicate(timeout=240)[0]
    output = outcome["output"]
    assert process.returncode in (0, 5), output[-6000:]  # 5: no page of the run defines a test
    assert ran.exists(), f"{page.label} did not run:\n{output[-3000:]}"
    assert json.loads(ran.read_text()) == expected, output[-3000:]


# Type-checked blocks ---------------------------------------------------------------------


def test_the_blocks_that_need_servers_type_check(tmp_path: Path) -> None:
    """mypy over the blocks marked typecheck, of the pages and the docstrings, in one run,
    with the project's settings for celery_lease."""
    package = tmp_path / "docs_examples"
    package.mkdir()
    (package / "__init__.py").write_text("")
    where: dict[str, tuple[str, dict[int, int]]] = {}
    for page in CHECKED + DOC_CHECKED:
        where[f"{page.slug}.py"] = (page.file, docblocks.write_typecheck_module(page, package))
    assert where, "no block is marked typecheck"
    assert DOC_CHECKED, "no docstring block is marked typecheck"
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "pyproject.toml", str(package)],
        cwd=ROOT,  # mypy's cache for celery_lease is the one `mypy celery_lease` fills
        env={**_env(), "MYPYPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    errors = []
    for line in run.stdout.splitlines():
        found = re.match(r".*?docs_examples/(\w+\.py):(\d+): (.*)", line)
        if found:
            page, lines = where[found[1]]
            errors.append(f"{page}:{lines.get(int(found[2]), '?')}: {found[3]}")
    assert run.returncode == 0, "\n".join(errors) or run.stdout[-3000:] + run.stderr[-2000:]


# Command lines ---------------------------------------------------------------------------

COMMANDS = [c for page in PARSED.values() for c in page.commands]


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    """``--help`` of every ``celery lease`` subcommand and ``celery worker``, through the real
    ``celery`` command line (its entry point loads the ``lease`` group), in one process."""
    script = f"""
import json, sys
from click.testing import CliRunner
from celery.bin.celery import celery
out = {{}}
for path in json.loads(sys.argv[1]):
    result = CliRunner().invoke(celery, ["-A", "{CLI_APP}", *path, "--help"])
    out[" ".join(path)] = result.output if result.exit_code == 0 else ""
print(json.dumps(out))
"""
    paths = sorted({tuple(docblocks.command_options(c.text)[0]) for c in COMMANDS if _ours(c)})
    run = subprocess.run(
        [sys.executable, "-c", script, json.dumps(paths)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(run.stdout)  # type: ignore[no-any-return]


def _ours(command: docblocks.Command) -> bool:
    path, _ = docblocks.command_options(command.text)
    return command.text.startswith("celery ") and path[:1] in (["lease"], ["worker"])


def test_the_commands_and_options_the_docs_show_exist(helps: dict[str, str]) -> None:
    """Every ``celery -A proj lease ...`` / ``worker --lease-...`` shown names a real
    subcommand and real options (the checker itself is checked in the next test)."""
    wrong = []
    shown = [c for c in COMMANDS if _ours(c)]
    assert len(shown) > 10
    for command in shown:
        path, options = docblocks.command_options(command.text)
        text = helps[" ".join(path)]
        if not text:
            wrong.append(f"{command.where}: no command `celery {' '.join(path)}`")
            continue
        known = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", text))
        wrong += [
            f"{command.where}: `{command.text}`: no option {o}" for o in options if o not in known
        ]
    assert wrong == []


def test_the_command_check_catches_a_made_up_option(helps: dict[str, str]) -> None:
    """Negative control: the same check refuses an option and a subcommand that do not exist."""
    path, options = docblocks.command_options("celery -A proj lease ls [--owner O] [--json]")
    known = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", helps[" ".join(path)]))
    assert [o for o in options if o not in known] == ["--owner"]


def test_install_lines_name_real_extras_and_files_exist() -> None:
    section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
    extras = set(re.findall(r"^(\w+) = \[", section.split("\n[")[0], re.M))
    assert {"redis", "postgres", "prometheus"} <= extras
    wrong = []
    for command in COMMANDS:
        words = command.text.split()
        if command.text.startswith("pip install "):
            for word in words[2:]:
                found = re.fullmatch(r"[\"']?celery-lease(?:\[([\w,]+)\])?[\"']?", word)
                if found and found[1]:
                    wrong += [
                        f"{command.where}: extra {e}"
                        for e in found[1].split(",")
                        if e not in extras
                    ]
        elif command.text.startswith("bash ") and not (ROOT / words[1]).is_file():
            wrong.append(f"{command.where}: no file {words[1]}")
        elif command.text.startswith("python -m ") and importlib.util.find_spec(words[2]) is None:
            wrong.append(f"{command.where}: no module {words[2]}")
    assert wrong == []


def test_the_readme_links_exist() -> None:
    """The README is read on GitHub and PyPI, outside the site's link check."""
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    assert links
    assert [link for link in links if not (ROOT / link).exists()] == []


# Settings reference ----------------------------------------------------------------------


def _documented_settings(text: str) -> dict[str, str]:
    rows = re.findall(r"^\| `lease_(\w+)` \|(.*)\|$", text, re.M)
    return dict(rows)


@pytest.mark.parametrize("mode", ["as written", "one setting removed"])
def test_every_setting_is_in_the_reference_with_its_default(mode: str) -> None:
    """Each LeaseSettings field has a row in docs/settings.md: its app.conf key, its class
    attribute, its keyword and its default. (The second run drops a row: it must be caught.)"""
    text = (ROOT / "docs" / "settings.md").read_text()
    if mode != "as written":
        text = re.sub(r"^\| `lease_retention` .*\n", "", text, flags=re.M)
    rows = _documented_settings(text)
    problems = []
    for f in fields(LeaseSettings):
        row = rows.get(f.name)
        if row is None:
            problems.append(f"lease_{f.name}: no row")
            continue
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if f.name == "store_url":
            shown = "(required"
        elif default is None:
            shown = {"renew_interval": "(ttl / 3)", "self_fence_margin": "(ttl / 4)"}[f.name]
        elif isinstance(default, (bool, int, float)):
            shown = f"({default:g}" if not isinstance(default, bool) else f"({default}"
        else:
            shown = f"(`{default}`)"
        if shown not in row:
            problems.append(f"lease_{f.name}: default {shown!r} not in its row")
        attribute, keyword = row.split("|")[:2]
        if f"`lease_{f.name}`" not in attribute or f"`{f.name}=`" not in keyword:
            problems.append(f"lease_{f.name}: attribute or keyword column")
    if mode == "as written":
        assert problems == []
        assert set(SETTINGS_DOC) == {f.name for f in fields(LeaseSettings)}  # the short summary
    else:
        assert problems == ["lease_retention: no row"]
