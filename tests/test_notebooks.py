"""Every notebook is a pair: a jupytext percent script (reviewed, diffed) and the .ipynb (with a real run's
outputs, for readers on the web). The two must hold the same cells; nbval executes the .ipynb in `make test`."""

import jupytext
import pytest

from tests.conftest import REPO

SCRIPTS = sorted(path for path in (REPO / "notebooks").glob("[0-9][0-9]_*.py"))


def cells(notebook):
    return [(cell.cell_type, cell.source.strip()) for cell in notebook.cells]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.stem)
def test_the_script_and_the_notebook_hold_the_same_cells(script):
    notebook = script.with_suffix(".ipynb")
    assert notebook.exists(), f"run: jupytext --to ipynb {script.name}"
    assert cells(jupytext.read(script)) == cells(jupytext.read(notebook)), f"run: jupytext --sync {script.name}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.stem)
def test_the_committed_notebook_carries_outputs_and_a_parameters_cell(script):
    notebook = jupytext.read(script.with_suffix(".ipynb"))
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert any("parameters" in cell.metadata.get("tags", []) and "COURSE_QUICK" in cell.source for cell in code)
    assert all(cell.get("outputs") is not None for cell in code)
    assert sum(bool(cell.get("outputs")) for cell in code) >= len(code) // 2, "execute it before committing"
    assert not any(output.get("output_type") == "error" for cell in code for output in cell.get("outputs", []))


def test_there_are_notebooks():
    assert SCRIPTS
