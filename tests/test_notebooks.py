"""Every notebook in notebooks/ runs top to bottom on CPU."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

NOTEBOOKS = sorted(
    (pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb")
)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path):
  cells = json.loads(path.read_text())["cells"]
  code = "\n\n".join(
      "".join(cell["source"]) for cell in cells if cell["cell_type"] == "code"
  )
  script = tmp_path / "notebook.py"
  script.write_text(code)
  result = subprocess.run(
      [sys.executable, str(script)],
      cwd=tmp_path,
      capture_output=True,
      text=True,
      timeout=900,
      env={**os.environ, "MPLBACKEND": "Agg"},
  )
  assert result.returncode == 0, result.stderr[-3000:]


def test_there_are_notebooks():
  assert NOTEBOOKS
