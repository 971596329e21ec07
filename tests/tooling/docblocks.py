"""Code blocks of the docs pages, and what tests/test_docs.py does with each.

Every ```python block is either **executed** or **type-checked**; nothing is skipped:

* executed (the default): the blocks of one page run in order in one namespace (a later block
  uses names from an earlier one), inside a pytest run of their own in a scratch directory, so
  ``test_*`` functions and fixtures defined by a page run as tests, with
  ``celery_lease.testing`` loaded. A block with ``title="proj.py"`` (a fence attribute, shown as
  the file name on the site) is written to that file instead; a module is imported where the
  block stands, ``conftest.py`` and ``test_*.py`` are picked up by pytest.
* type-checked: a block that needs servers or a running worker is marked on the line before it
  with ``<!-- test: typecheck, <why> -->`` and is checked by mypy against the public API (the
  page's type-checked blocks, in order, as one module).

``<!-- test: setup`` ... ``-->`` holds code the reader does not need to see (a stand-in for
"your own code" such as ``open_logged_in_browser``, or a check that an example did what the
text says): it runs at that point of the page, and goes before the type-checked blocks after it.

Shell blocks and inline code that show ``celery -A proj lease ...`` or ``celery -A proj worker
...`` are checked against the real command line's ``--help``; ``pip install`` lines against the
extras in pyproject.toml; ``bash <file>`` and ``python -m <module>`` against the checkout.
"""

from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

LANGUAGES = {"python", "sh", "bash", "text", "json", "sql", ""}
SHELL = {"sh", "bash", ""}
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)(?P<attrs>.*)$")
TITLE = re.compile(r'title="(?P<title>[^"]+)"')
MARKER = re.compile(r"^<!--\s*test:\s*(?P<what>[a-z]+)(?P<rest>.*)$")
INLINE = re.compile(r"`((?:celery|bash|python -m) [^`\n]+)`")


class DocsError(Exception):
    """A page breaks the rules above (an unmarked or mis-marked block, an unknown fence)."""


@dataclass
class Block:
    page: Path
    line: int  # line number (1-based) of the block's first line of code in the page
    lang: str
    code: str
    mode: str  # exec | typecheck | setup | other
    title: str | None = None
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{_name(self.page)}:{self.line}"


@dataclass
class Command:
    page: Path
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{_name(self.page)}:{self.line}"


@dataclass
class Page:
    """A docs page, or one docstring of the package (``name``: its module and object)."""

    path: Path
    blocks: list[Block] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
    name: str = ""

    @property
    def has_files(self) -> bool:
        return any(b.title for b in self.blocks if b.mode == "exec")

    @property
    def slug(self) -> str:
        return re.sub(r"\W", "_", self.name or self.path.stem.lower())

    @property
    def file(self) -> str:
        """The file as failures name it: ``fencing.md``, ``celery_lease/fencing.py``."""
        return _name(self.path)

    @property
    def label(self) -> str:
        """How failures name the page: ``fencing.md``, ``celery_lease.fencing.FenceGate``."""
        return self.name or self.path.name

    def of(self, *modes: str) -> list[Block]:
        return [b for b in self.blocks if b.mode in modes]


def _name(path: Path) -> str:
    # Pages are named by file name (fencing.md); docstrings by their path in the checkout.
    return path.name if path.is_absolute() else path.as_posix()


def parse(path: Path) -> Page:
    """The page's blocks and commands; DocsError for anything the tests could not place."""
    return parse_lines(Page(path), path.read_text().splitlines(), 1)


def parse_lines(page: Page, lines: list[str], first: int) -> Page:
    """Add the blocks and commands of ``lines`` (``first``: the file's line number of
    ``lines[0]``) to ``page``; DocsError for anything the tests could not place."""
    path, at = page.path, first - 1
    name = _name(path)
    marker: tuple[str, str, int] | None = None  # (what, rest, line) waiting for its fence
    i = 0
    while i < len(lines):
        line = lines[i]
        match = MARKER.match(line)
        if match:
            what, rest = match["what"], match["rest"]
            if what == "setup":
                end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "-->"), None)
                if end is None or rest.strip():
                    raise DocsError(
                        f"{name}:{at + i + 1}: '<!-- test: setup' ends with '-->' alone"
                    )
                code = "\n".join(lines[i + 1 : end]) + "\n"
                page.blocks.append(Block(path, at + i + 2, "python", code, "setup"))
                i = end + 1
                continue
            if not rest.rstrip().endswith("-->"):
                raise DocsError(f"{name}:{at + i + 1}: a test marker is one line ending in -->")
            marker = (what, rest.rstrip()[:-3].strip(" ,:"), at + i + 1)
            i += 1
            continue
        if line.lstrip().startswith("```") and not line.startswith("```"):
            raise DocsError(f"{name}:{at + i + 1}: indented fence: the docs tests cannot see it")
        fence = FENCE.match(line)
        if not fence:
            if marker is not None and line.strip():
                raise DocsError(f"{name}:{marker[2]}: a test marker must precede a fence")
            page.commands += _inline_commands(path, at + i + 1, line)
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        if end is None:
            raise DocsError(f"{name}:{at + i + 1}: unclosed fence")
        lang = fence["lang"]
        if lang not in LANGUAGES:
            raise DocsError(
                f"{name}:{at + i + 1}: fence language {lang!r} is not one of {LANGUAGES}"
            )
        title = TITLE.search(fence["attrs"])
        block = Block(
            path,
            at + i + 2,
            lang,
            "\n".join(lines[i + 1 : end]) + "\n",
            "other",
            title["title"] if title else None,
        )
        if lang == "python":
            block.mode = "exec"
            if marker is not None:
                what, reason, _ = marker
                if what == "typecheck" and reason:
                    block.mode, block.reason = "typecheck", reason
                elif what != "exec":
                    raise DocsError(
                        f"{name}:{at + i}: marker {what!r}: use '<!-- test: typecheck, <why> -->' "
                        "(a reason is required) or none (the block is executed)"
                    )
        elif marker is not None:
            raise DocsError(f"{name}:{at + i}: test markers apply to python blocks only")
        if lang in SHELL:
            for n, raw in enumerate(block.code.splitlines()):
                text = raw.strip().removeprefix("$ ")
                if text.startswith(("celery ", "pip install ", "bash ", "python -m ")):
                    page.commands.append(Command(path, block.line + n, text.split("  #")[0]))
        marker = None
        page.blocks.append(block)
        i = end + 1
    return page


def _inline_commands(path: Path, number: int, line: str) -> list[Command]:
    return [Command(path, number, m) for m in INLINE.findall(line)]


def command_options(text: str) -> tuple[list[str], list[str]]:
    """``celery -A proj lease ls [--prefix P]`` -> (["lease", "ls"], ["--prefix"])."""
    words = shlex.split(text.replace("[", " ").replace("]", " ").replace("|", " "))
    words = [w for w in (words[3:] if words[1:2] == ["-A"] else words[1:]) if w != "..."]
    path = [w for w in words[:2] if not w.startswith("-")]
    options = [w.split("=")[0] for w in words if w.startswith("-") and w != "-"]
    return path, options


# The program a page's executed blocks become: each block compiled under the page's own file
# name and line numbers, so a failure points at the line in the docs.
PAGE_MODULE = '''\
"""Executed blocks of {page} (generated by tests/test_docs.py)."""

import importlib as _importlib
import json as _json

_BLOCKS = {blocks!r}
_RAN = []
for _kind, _where, _line, _code in _BLOCKS:
    if _kind == "import":
        _importlib.import_module(_code)
    else:
        exec(compile("\\n" * (_line - 1) + _code, _where, "exec"), globals())  # noqa: S102
    _RAN.append(_line)
with open({ran!r}, "w") as _out:
    _json.dump(_RAN, _out)
'''

PYTEST_INI = """\
[pytest]
addopts = -p no:cacheprovider
timeout = 60
filterwarnings =
    error
    ignore::DeprecationWarning:kombu.*
    ignore::DeprecationWarning:celery.*
"""


def write_page_program(page: Page, into: Path) -> list[int]:
    """Write the page's executed blocks into a pytest directory; returns the lines that must run.

    Pages without files of their own (titled blocks) may share a directory and a process (one
    start-up instead of six). They still have a namespace each, but Celery's registry of shared
    tasks is per process: an app finalized on one page gets the shared tasks of the others, so a
    page that defines the same task name twice (migrating.md's before/after) must not finalize
    an app. Give a page a titled file to run it alone.
    """
    into.mkdir(parents=True, exist_ok=True)
    steps: list[tuple[str, str, int, str]] = []
    files: dict[str, str] = {}
    for block in page.of("exec", "setup"):
        if block.title:
            if not block.title.endswith(".py"):
                raise DocsError(f"{block.where}: a titled python block is a .py file")
            if (into / block.title).exists() and block.title not in files:
                raise DocsError(f"{block.where}: {block.title} exists (pages share a directory)")
            files[block.title] = files.get(block.title, "") + block.code
            name = block.title[:-3]
            if name != "conftest" and not name.startswith("test_"):
                steps.append(("import", str(page.path), block.line, name))
            else:
                steps.append(("file", str(page.path), block.line, "pass\n"))
        else:
            steps.append(("exec", str(page.path), block.line, block.code))
    for name, code in files.items():
        (into / name).write_text(code)
    if not (into / "conftest.py").exists():
        (into / "conftest.py").write_text('pytest_plugins = ["celery_lease.testing"]\n')
    (into / "pytest.ini").write_text(PYTEST_INI)
    ran = into / f"ran_{page.slug}.json"
    (into / f"test_docs_page_{page.slug}.py").write_text(
        PAGE_MODULE.format(page=page.path.name, blocks=steps, ran=str(ran))
    )
    return [line for _, _, line, _ in steps]


def write_typecheck_module(page: Page, into: Path) -> dict[int, int]:
    """Write the page's type-checked blocks, each after the setup code before it, as one module
    (one namespace per page, as for executed blocks).

    Returns the module's line -> the page's line, for mypy's messages.
    """
    lines: list[str] = []
    where: dict[int, int] = {}
    for part in page.of("setup", "typecheck"):
        for n, text in enumerate(part.code.splitlines()):
            lines.append(text)
            where[len(lines)] = part.line + n
    (into / f"{page.slug}.py").write_text("\n".join(lines) + "\n")
    return where


# Docstrings ------------------------------------------------------------------------------
# The API reference (docs/api.md) renders the package's docstrings as Markdown, so their code
# examples follow the pages' rules: a ```python block is executed (one namespace per
# docstring) or marked typecheck with a reason. What would show code that neither happens to
# is refused: an RST literal block (``Example::``), a doctest (``>>>``), an indented code
# block, an ``Example:`` section.

#: A Google-style section header (``Args:``, ``Raises:``, or an admonition ``Note:``) when the
#: next line is indented: that body is text, not code.
SECTION = re.compile(r"^(?P<title>\w[\w -]*):\s*$")
LIST_ITEM = re.compile(r"^(?:[*+-]|\d+[.)])\s")
EXAMPLE_SECTIONS = {"Example", "Examples", "Usage"}
HOW = (
    "write it as a ```python block at the docstring's top level (executed), with "
    "'<!-- test: typecheck, <why> -->' before it when it cannot run, or ```text if it is not Python"
)


def docstrings(package: Path, root: Path) -> tuple[list[Page], list[str]]:
    """The docstrings under ``package`` that hold python blocks, one Page each, and every
    example the tests could not place (``path:line: what``)."""
    pages: list[Page] = []
    problems: list[str] = []
    for file in sorted(package.rglob("*.py")):
        rel = file.relative_to(root)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        seen: set[str] = set()
        for scope, node in _string_statements(ast.parse(file.read_text()), ""):
            name = f"{module}.{scope}" if scope else module
            if name in seen:  # an attribute docstring next to its class's own
                name = f"{name}_{node.lineno}"
            seen.add(name)
            page = Page(rel, name=name)
            try:
                lines = _docstring_lines(rel, node)
                _refuse_unchecked_code(rel, lines, node.lineno)
                parse_lines(page, lines, node.lineno)
            except DocsError as exc:
                problems.append(str(exc))
                continue
            if page.of("exec", "typecheck", "setup"):
                pages.append(page)
    return pages, problems


def _string_statements(tree: ast.AST, scope: str) -> Iterator[tuple[str, ast.Constant]]:
    """Every bare string statement (docstrings, attribute docstrings), with its scope."""
    for node in ast.iter_child_nodes(tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            yield scope, node.value
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _string_statements(node, f"{scope}.{node.name}".lstrip("."))
        else:
            yield from _string_statements(node, scope)


def _docstring_lines(path: Path, node: ast.Constant) -> list[str]:
    """The docstring as the API reference shows it (indentation removed, as inspect.cleandoc
    does), one entry per line of the file from ``node.lineno`` on."""
    text = str(node.value)
    if text.count("\n") != (node.end_lineno or node.lineno) - node.lineno and re.search(
        r"```|::$|>>>", text, re.M
    ):
        raise DocsError(
            f"{_name(path)}:{node.lineno}: escape sequences move this docstring's lines away "
            'from the file\'s: make it a raw string (r""")'
        )
    lines = text.split("\n")
    indent = min((len(s) - len(s.lstrip()) for s in lines[1:] if s.strip()), default=0)
    return [lines[0].lstrip(), *(s[indent:] for s in lines[1:])]


def _refuse_unchecked_code(path: Path, lines: list[str], first: int) -> None:
    """DocsError for code the API reference would show but no test runs or type-checks."""
    fenced = comment = False
    context = "text"  # what an indented line continues: text | section | list
    for i, line in enumerate(lines):
        where = f"{_name(path)}:{first + i}"
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
            continue
        if comment or stripped.startswith("<!--"):
            comment = "-->" not in stripped
            continue
        if fenced or not stripped:
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            after = lines[i + 1] if i + 1 < len(lines) else ""
            section = SECTION.match(line) if after[:1].isspace() and after.strip() else None
            if section and section["title"] in EXAMPLE_SECTIONS:
                raise DocsError(f"{where}: an {section['title']}: section is not checked: {HOW}")
            context = "section" if section else "list" if LIST_ITEM.match(line) else "text"
        if stripped.startswith(">>>"):
            raise DocsError(f"{where}: a doctest (>>>) is neither run nor type-checked: {HOW}")
        if stripped.endswith("::"):
            raise DocsError(
                f"{where}: a literal block (::) is neither run nor type-checked "
                f"(and the site shows the '::'): {HOW}"
            )
        if indent >= 4 and context == "text" and i > 0 and not lines[i - 1].strip():
            raise DocsError(
                f"{where}: an indented block shows as code but is neither run nor "
                f"type-checked: {HOW}"
            )
