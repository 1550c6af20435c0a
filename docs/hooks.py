"""MkDocs hook: the committed study results join the site, so the guides'
links to ``../experiments/results/...`` (right on GitHub) are checked and
served by ``mkdocs build --strict`` too."""

import pathlib
import re

from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).parents[1]
RESULTS = "experiments/results"
_LINK = re.compile(r"\]\(\.\./" + re.escape(RESULTS) + "/")


def on_files(files, config):
  """Adds every file under experiments/results/ (quick runs aside)."""
  for path in sorted((ROOT / RESULTS).rglob("*")):
    relative = path.relative_to(ROOT)
    if path.is_file() and not relative.parts[2].endswith("-quick"):
      files.append(
          File(
              relative.as_posix(),
              str(ROOT),
              config["site_dir"],
              config["use_directory_urls"],
          )
      )
  return files


def on_page_markdown(markdown, page, config, files):
  """Points a guide's ``../experiments/results/`` links at the added files
  (the guides sit at the top of docs/)."""
  del page, config, files
  return _LINK.sub("](" + RESULTS + "/", markdown)
