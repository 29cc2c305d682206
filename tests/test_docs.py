"""The documentation is checked like code: the Python examples of README.md and
of every page of docs/ run as written, every relative link between the
Markdown files resolves (to a file, and to a heading where it names one),
BENCHMARKS.md keeps the markers the benchmarks rewrite, and every benchmark
still runs (a smoke run of ``benchmarks/run.py NAME --quick``, nothing written)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
DOCS_INDEX = DOCS / "README.md"
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
CHANGELOG = ROOT / "CHANGELOG.md"
# The pages whose ```python blocks the suite runs: the front page and the manual.
PAGES = [README, *sorted(DOCS.glob("*.md"))]
# The files whose relative links must resolve.
LINKED = [*PAGES, BENCHMARKS_MD, CHANGELOG]
# Which benchmarks exist, which sections of BENCHMARKS.md each writes and where
# its --quick run is checked: benchmarks/harness/registry.py.
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import registry  # noqa: E402  pylint: disable=wrong-import-position
# The README is the front page; the detail lives in docs/.
README_MAX_LINES = 250
# Project files speak of dates, machines and commands, not of how the work was
# organised: the words the shared before-stop hook greps for (spelled with
# character classes, so that its grep does not find this line).
ORGANISATION_WORDS = re.compile(r"\bstop [0-9]+\b|\bthe help[e]r|help[e]r[']s", re.IGNORECASE)

# Runs a page's blocks in order in one namespace, as a reader would (a later
# block may use what an earlier one made), and names the block that failed.
_DRIVER = """
import sys, traceback
page, blocks = {page!r}, {blocks!r}
namespace = {{"__name__": "__main__"}}
for i, code in enumerate(blocks):
  try:
    exec(compile(code, f"{{page}} python block {{i + 1}}", "exec"), namespace)
  except BaseException:
    traceback.print_exc()
    sys.exit(f"{{page}}: python block {{i + 1}} of {{len(blocks)}} failed:\\n{{code}}")
"""


def python_blocks(markdown: str) -> list[str]:
  """The bodies of the ```python fenced blocks of a Markdown text."""
  return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.DOTALL | re.MULTILINE)


def _prose(markdown: str) -> str:
  """The text outside fenced code blocks and inline code spans."""
  text = re.sub(r"^```.*?^```", "", markdown, flags=re.DOTALL | re.MULTILINE)
  text = re.sub(r"^    .*$", "", text, flags=re.MULTILINE)  # indented code blocks
  return re.sub(r"`[^`\n]*`", "", text)


def relative_links(markdown: str) -> list[str]:
  """The targets of the inline links and link definitions that are not URLs."""
  prose = _prose(markdown)
  targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose)
  targets += re.findall(r"^\s*\[[^\]]+\]:\s*(\S+)", prose, flags=re.MULTILINE)
  return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t, flags=re.IGNORECASE)]


def anchors(markdown: str) -> set[str]:
  """The fragment ids GitHub gives the headings of a Markdown text."""
  seen: dict[str, int] = {}
  found = set()
  text = re.sub(r"^```.*?^```", "", markdown, flags=re.DOTALL | re.MULTILINE)
  for title in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.MULTILINE):
    slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    found.add(slug if n == 0 else f"{slug}-{n}")
  return found


def _env(tmp_path: pathlib.Path) -> dict[str, str]:
  src = str(ROOT / "src")
  return dict(os.environ, TUNEDJAX_CACHE_DIR=str(tmp_path / "cache"), JAX_PLATFORMS="cpu",
              PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))


def _name(path: pathlib.Path) -> str:
  return path.relative_to(ROOT).as_posix()


def test_python_blocks_are_found():
  assert len(python_blocks(README.read_text())) >= 2  # the Trainer and tj.jit
  every = [b for page in PAGES for b in python_blocks(page.read_text())]
  assert len(every) >= 15
  assert any("mp.wrap" in b for b in every) and any("select_kernels" in b for b in every)


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p.read_text())], ids=_name)
def test_python_blocks_run(page, tmp_path):
  blocks = python_blocks(page.read_text())
  result = subprocess.run([sys.executable, "-c", _DRIVER.format(page=_name(page), blocks=blocks)],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=600, check=False)
  assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize("page", LINKED, ids=_name)
def test_relative_links_resolve(page):
  broken = []
  for target in relative_links(page.read_text()):
    path, _, fragment = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    if not linked.exists():
      broken.append(f"{target}: no file {linked}")
    elif fragment and linked.suffix == ".md" and fragment not in anchors(linked.read_text()):
      broken.append(f"{target}: no heading #{fragment} in {_name(linked)}")
  assert not broken, f"{_name(page)} links to what is not there:\n" + "\n".join(broken)


def test_the_docs_index_lists_every_page():
  listed = {(DOCS / t.partition("#")[0]).resolve() for t in relative_links(DOCS_INDEX.read_text())}
  missing = [_name(p) for p in DOCS.glob("*.md") if p != DOCS_INDEX and p.resolve() not in listed]
  assert not missing, f"docs/README.md does not list {missing}"


def test_readme_is_the_front_page():
  text = README.read_text()
  assert "make test" in text and "make demo" in text  # CI and the before-stop hook look for them
  lines = text.count("\n")
  assert lines <= README_MAX_LINES, (
      f"README.md has {lines} lines (at most {README_MAX_LINES}): move the detail to docs/")


def test_benchmark_sections_keep_their_markers():
  text = BENCHMARKS_MD.read_text()
  markers = re.findall(r"<!-- ([a-z0-9_]+):(start|end) -->", text)
  names = [name for name, kind in markers if kind == "start"]
  assert len(names) == len(set(names)), f"a section appears twice: {names}"
  # Each start is followed by its own end, with no other marker in between.
  assert markers == [(n, k) for n in names for k in ("start", "end")], markers
  missing = (registry.written_sections() | set(registry.HAND_WRITTEN)) - set(names)
  assert not missing, f"BENCHMARKS.md lost the markers of {sorted(missing)}"


def test_every_benchmark_module_is_in_the_registry():
  modules = {p.stem for p in (ROOT / "benchmarks").glob("[!_]*.py")} - {"run"}
  assert modules == set(registry.BY_NAME), (
      "benchmarks/harness/registry.py must list every benchmark module: "
      f"unlisted {sorted(modules - set(registry.BY_NAME))}, "
      f"without a module {sorted(set(registry.BY_NAME) - modules)}")


@pytest.mark.parametrize("page", LINKED, ids=_name)
def test_pages_speak_of_dates_machines_and_commands(page):
  found = [line for line in page.read_text().splitlines() if ORGANISATION_WORDS.search(line)]
  assert not found, f"{_name(page)}: say when, where and with which command instead:\n" + "\n".join(found)


@pytest.mark.slow
@pytest.mark.parametrize("bench", [
    pytest.param(b, marks=pytest.mark.bench_smoke) if b.smoke == "bench-smoke" else b
    for b in registry.BENCHMARKS if b.smoke != "own"], ids=lambda b: b.name)
def test_benchmark_smoke_run(bench, tmp_path):
  result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), bench.name,
                           "--quick"], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=600, check=False)
  assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
