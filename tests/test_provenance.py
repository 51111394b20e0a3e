"""Every figure has a source (``scripts/provenance.py``): quoted outputs equal the committed files they quote, and
every figure in a lesson is printed in a committed output or derived, in the lesson's own table, from one that is."""

import json
import re

import pytest

from tests.conftest import PYTHON, REPO, load_script, run_command

provenance = load_script(REPO / "scripts" / "provenance.py")
LESSONS = provenance.LESSONS


@pytest.fixture(scope="module")
def printed():
    return provenance.sources()


def test_figures_are_decimals_percentages_and_ratios_outside_code_and_links():
    text = (
        "PyTorch 2.14.1 at 198.18.0.100 took 32.42 ms, 95.26% and 12 % of it, 1.40x or 1.4× faster, on 4 GPUs.\n"
        "```bash\ntorchrun --lr 0.05 x.py\n```\n"
        "A `--bucket-cap-mb 0.5` flag, [a paper](https://arxiv.org/abs/1910.02054), and 3,854.5 samples/s.\n"
        "```\nepoch 1/5: loss 2.2166\n```\n"
    )
    assert provenance.figures(text) == [
        (1, "32.42"),
        (1, "95.26%"),
        (1, "12%"),
        (1, "1.40x"),
        (1, "1.4x"),
        (5, "3,854.5"),
        (7, "2.2166"),  # a plain block is an output: its figures need a source too
    ]
    # a load average is sourced by a recording's header only, and a header sources nothing else
    assert provenance.figures("Loaded (load average 10.4 and\n6.9), it took 6.9 ms; under this load, 227.7 ms.") == [
        (1, "load 10.4"),
        (2, "load 6.9"),
        (2, "6.9"),
        (2, "227.7"),
    ]


def test_a_figure_is_sourced_by_a_printed_number_or_a_derived_row_that_holds(tmp_path, monkeypatch):
    lesson = tmp_path / "99_demo.md"
    lesson.write_text(
        "It took 32.42 ms, 1.40x less, 7% of the step; 2.5 is made up.\n\n"
        "## Derived numbers\n\n| figure | how |\n|---|---|\n| 1.40x | 45.39 / 32.42 |\n| 7% | 2.27 / 32.42 |\n"
    )
    printed = {"32.42", "45.39"}
    assert provenance.unsourced_figures(lesson, printed) == [
        "line 1: 2.5",
        "derived numbers: 7%: derived from 2.27",  # its row uses 2.27, which nothing printed
    ]
    printed.add("2.27")
    assert provenance.unsourced_figures(lesson, printed) == ["line 1: 2.5"]
    # measurements written with thousands separators count as inputs; units (1,048,576 bytes in a MiB) do not
    lesson.write_text(
        "It lost 13.5% and 20.0 MB.\n\n## Derived numbers\n\n| figure | how |\n|---|---|\n"
        "| 13.5% | (1,622 - 1,403) / 1,622 |\n| 20.0 | 19.1 x 1,048,576 / 1,000,000 |\n"
    )
    assert provenance.unsourced_figures(lesson, {"1622", "19.1"}) == ["derived numbers: 13.5%: derived from 1403"]


def test_a_quoted_output_is_filled_from_its_file_and_a_stale_or_orphan_block_is_caught(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "run.txt").write_text("header\nline 2\nline 3\nline 4\nline 5\n")
    block = "<!-- output: results/run.txt lines 2-2,4-5 -->\n```text\nold\n```\n<!-- end output -->\n"
    assert provenance.filled("Intro.\n" + block) == (
        "Intro.\n<!-- output: results/run.txt lines 2-2,4-5 -->\n```text\nline 2\n...\nline 4\nline 5\n```\n"
        "<!-- end output -->\n"
    )
    with pytest.raises(provenance.ProvenanceError, match="no such committed file"):
        provenance.filled(block.replace("run.txt", "gone.txt"))
    with pytest.raises(provenance.ProvenanceError, match="the source has 5 lines"):
        provenance.filled(block.replace("4-5", "4-9"))


def test_a_quoted_notebook_cell_is_what_that_cell_printed(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    cell = {
        "id": "abc1",
        "cell_type": "code",
        "outputs": [{"output_type": "stream", "name": "stdout", "text": "a 1.5\n"}],
    }
    (tmp_path / "n.ipynb").write_text(json.dumps({"cells": [cell]}))
    assert provenance.source_text("n.ipynb", "abc1") == "a 1.5\n"
    with pytest.raises(provenance.ProvenanceError, match="no cell with id zzz"):
        provenance.source_text("n.ipynb", "zzz")


def test_every_quoted_output_equals_its_committed_source():
    run = run_command([PYTHON, "scripts/provenance.py", "--check"], timeout=60)
    assert run.returncode == 0, run.output


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda path: path.stem)
def test_every_figure_of_the_lesson_is_printed_in_a_committed_output_or_derived_from_one(lesson, printed):
    assert provenance.unsourced_figures(lesson, printed) == []


def test_record_heads_the_output_with_the_machine_the_date_the_load_and_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    path = provenance.record("demo", [PYTHON, "-c", "print('took 1.25 ms')"], timeout=60)
    header, command, output = path.read_text().splitlines()
    assert path.parent.parent == tmp_path / "results" and path.name == "demo.txt"
    assert "CPU cores" in header and "PyTorch" in header and " UTC; load average " in header
    assert command.startswith("$ ") and command.endswith("-c 'print('\"'\"'took 1.25 ms'\"'\"')'")
    assert output == "took 1.25 ms"
    with pytest.raises(provenance.ProvenanceError, match="failed"):
        provenance.record("demo", [PYTHON, "-c", "raise SystemExit(3)"], timeout=60)


def test_every_benchmark_prints_where_and_when_it_ran_before_its_figures():
    # its first print, in main, carries common.reports.run_header(): machine_summary() and the UTC time
    silent = []
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        main = path.read_text().split("\ndef main", 1)[-1]
        first_print = re.search(r"^\s+print0?\((.*)$", main, flags=re.MULTILINE)
        if first_print is None or "run_header()" not in first_print.group(1):
            silent.append(path.name)
    assert silent == []


def test_the_run_header_names_the_cpu_its_cores_pytorch_and_the_utc_time():
    from common.reports import run_header

    header = run_header()
    when = r"\d{4}-\d\d-\d\d \d\d:\d\d UTC; load average \d+\.\d, \d+\.\d, \d+\.\d"
    assert re.fullmatch(r".+, \d+ CPU cores(, GPUs: .+)?; PyTorch \S+; " + when, header), header


@pytest.mark.parametrize("notebook", sorted((REPO / "notebooks").glob("*.ipynb")), ids=lambda path: path.stem)
def test_every_notebook_says_where_and_when_its_committed_outputs_were_printed(notebook):
    cells = [cell for cell in json.loads(notebook.read_text())["cells"] if cell["cell_type"] == "code"]
    first = "".join(provenance._printed(output) for output in cells[0].get("outputs", []))
    assert re.search(r"CPU cores.*; PyTorch \S+.*\d{4}-\d\d-\d\d \d\d:\d\d UTC", first, re.DOTALL), first or "no output"


def test_a_headers_load_average_sources_a_load_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    (tmp_path / "results" / "cpu-demo").mkdir(parents=True)
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "results" / "cpu-demo" / "run.txt").write_text(
        "AMD EPYC, 2 CPU cores; PyTorch 2.14.1; 2026-11-27 08:00 UTC; load average 5.4, 3.0, 2.5\nstep 1.25 ms, 12%\n"
    )
    printed = provenance.sources()
    assert {"load 5.4", "load 3.0", "load 2.5", "1.25", "12%"} <= printed
    assert "5.4" not in printed and "2.5" not in printed
