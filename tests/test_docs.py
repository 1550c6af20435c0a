"""The guides build and their examples run.

- ``mkdocs build --strict`` builds docs/ (with mkdocs.yml) into a temporary
  folder: a warning fails it, so a broken link between pages, a missing
  anchor or a link to a missing results file fails the test.
- README.md's relative links point at files that exist, and it keeps the two
  set-up commands that CI runs word for word.
- Every fenced code block whose info string is ``python`` in README.md and
  docs/*.md runs, the blocks of one page in order in one namespace (a block
  may use what an earlier block of its page defined). A block that cannot run
  on a CPU in seconds is marked ```` ```python no-run ```` and is skipped;
  keep such blocks few. Any other info string starting with ``python`` is an
  error, so that a misspelt mark cannot skip a block silently.
"""

import contextlib
import io
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SETUP_COMMANDS = [
    'pip install torch==2.13.0 -e ".[test]" && pytest -q -n 2',
    "pip install -e . && logra train",
]
_FENCE = re.compile(r"^```(.*)$")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _code_blocks(page: pathlib.Path) -> list[tuple[str, int, str]]:
  """The fenced blocks of a page as ``(info string, first line, code)``."""
  blocks, info, start, lines = [], None, 0, []
  for number, line in enumerate(page.read_text().splitlines(), 1):
    fence = _FENCE.match(line)
    if info is None and fence:
      info, start, lines = fence.group(1).strip(), number + 1, []
    elif info is not None and line == "```":
      blocks.append((info, start, "\n".join(lines) + "\n"))
      info = None
    elif info is not None:
      lines.append(line)
  assert (
      info is None
  ), f"{page.name}: a code block opened on line {start - 1} never closes"
  return blocks


def test_site_builds_without_warnings(tmp_path):
  pytest.importorskip("mkdocs")
  result = subprocess.run(
      [
          sys.executable,
          "-m",
          "mkdocs",
          "build",
          "--strict",
          "--config-file",
          str(ROOT / "mkdocs.yml"),
          "--site-dir",
          str(tmp_path / "site"),
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      check=False,
  )
  assert result.returncode == 0, result.stderr
  assert (tmp_path / "site" / "index.html").is_file()


def test_readme_links_resolve():
  readme = (ROOT / "README.md").read_text()
  missing = [
      target
      for target in _LINK.findall(readme)
      if "://" not in target
      and not target.startswith("#")
      and not (ROOT / target.split("#")[0]).exists()
  ]
  assert not missing, f"README.md links to missing files: {missing}"


@pytest.mark.parametrize("command", SETUP_COMMANDS)
def test_readme_keeps_the_setup_commands(command):
  lines = (ROOT / "README.md").read_text().splitlines()
  assert (
      command in lines
  ), f"README.md must keep the line {command!r} (CI runs it)"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_python_examples_run(page):
  namespace = {"__name__": f"docs_{page.stem}"}
  for info, line, code in _code_blocks(page):
    if not info.startswith("python"):
      continue
    assert info in ("python", "python no-run"), (
        f"{page.name}:{line}: info string {info!r}; use 'python' or "
        "'python no-run'"
    )
    if info == "python no-run":
      continue
    # Padded so that a traceback gives the line numbers of the page.
    compiled = compile("\n" * (line - 1) + code, str(page), "exec")
    with contextlib.redirect_stdout(io.StringIO()):
      exec(compiled, namespace)
