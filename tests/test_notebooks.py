"""Execute every notebook in notebooks/ (new ones are picked up automatically)."""

import os
import pathlib
import time

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert any(path.name == "quickstart.ipynb" for path in NOTEBOOKS)


# Every notebook runs with the slow tests (a kernel of its own and its compilations: the
# quickstart 12-25 s, the others 15-20 s, batch_policy about 65 s); `.ci/run` runs them.
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_without_errors(path):
    notebook = nbformat.read(path, as_version=4)
    # "python3" is ipykernel's native kernel: jupyter_client provides it for the running
    # interpreter even when no kernel spec was installed, as in a fresh virtual environment.
    client = NotebookClient(notebook, kernel_name="python3", timeout=600,
                            resources={"metadata": {"path": str(path.parent)}})
    # The kernel imports perfmodel from this checkout, as the tests do.
    path_entries = filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path_entries),
               MPLBACKEND="module://matplotlib_inline.backend_inline")
    start = time.perf_counter()
    client.execute(env=env)   # raises CellExecutionError, with the cell, on any error
    elapsed = time.perf_counter() - start
    errors = [o for cell in notebook.cells if cell.cell_type == "code"
              for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    if path.name == "quickstart.ipynb":
        assert elapsed < 120.0   # seconds; about 30 s on two busy cores
