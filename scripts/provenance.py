"""Where the lessons' figures come from: quoted outputs filled from committed files, and every figure traced.

Two jobs, one rule (a figure in a lesson is one the course printed into a committed output):

1. **Quoted outputs are generated, not pasted.** A lesson marks a block with the file it quotes::

       <!-- output: results/cpu-amd-epyc-2core/profile_run.txt lines 3-9,14-20 -->
       ```text
       ...
       ```
       <!-- end output -->

   ``python scripts/provenance.py`` rewrites each block's body from its file (the lines named, ``...`` where a
   range is left out); ``--check`` changes nothing and fails if a block differs or its file is missing, as
   ``scripts/make_labs.py`` does for labs. A notebook is a source too: ``notebooks/NN_name.ipynb cell <id>`` quotes
   the text that cell printed.

2. **Every figure has a source.** A figure is a decimal number (``95.26``), a percentage (``12%``) or a ratio
   (``1.40x``) in a lesson's text, code and inline code left out. It is *sourced* when the same number is printed
   in a committed output (any notebook's outputs, any file under ``results/``), or when the lesson's own
   ``## Derived numbers`` table lists it with how it was derived: from figures that are themselves sourced, or from
   a paper that the row cites. ``--figures`` lists, lesson by lesson, the figures with no source.

``record`` runs a documented command and commits its output as a source, headed by the machine, PyTorch's version,
the date and the command itself::

    python scripts/provenance.py record profile_run -- torchrun --standalone --nproc_per_node=2 \\
        solutions/06_profiling.py --dataset digits --trace-dir traces
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LESSONS = sorted((REPO / "lessons").glob("[0-9][0-9]_*.md"))
QUOTING = [*LESSONS, REPO / "README.md"]  # documents whose output blocks are filled (the README quotes the demo)
SOURCE_SUFFIXES = {".txt", ".md", ".json", ".csv"}

BLOCK = re.compile(
    r"(?P<open><!-- output: (?P<source>\S+)(?: cell (?P<cell>[\w-]+))?(?: lines (?P<lines>[\d,-]+))? -->\n)"
    r"(?P<fence>```\w*\n)(?P<body>.*?)(?P<close>```\n<!-- end output -->)",
    re.DOTALL,
)
# Code is left out; a plain ``` block (an output, a diagram) is read like prose: its figures need sources too.
CODE_FENCE = re.compile(r"^```(?:bash|sh|python|console)\n.*?^```[ \t]*$", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]+`")
LINK_TARGET = re.compile(r"\]\([^)]*\)|https?://\S+|<!--.*?-->", re.DOTALL)
# A figure: a number with a decimal point (one point only: 2.14.1 is a version, 198.18.0.1 an address), a percentage
# or a ratio. Integers alone (4 GPUs, 2 processes) are counts, not measurements.
FIGURE = re.compile(r"(?<![\w.,])(\d+(?:,\d{3})*(?:\.\d+)?)(?![\d,]*\.\d)(?P<unit> ?%|x\b|×)?")
LOAD_BEFORE = re.compile(r"\bload(?: average)?(?: of)?[ (:]*(?:\d+\.\d+(?:,| and| then)?\s*)*$")
LOAD = re.compile(r"load average(?: \(1 min\))?:? ((?:\d+\.\d+(?:, )?)+)")
NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?![\d])")


class ProvenanceError(Exception):
    pass


# -- 1. quoted outputs ----------------------------------------------------------------------------------------------


def source_text(source: str, cell: str | None = None) -> str:
    """The text a block quotes: a committed file, or what one notebook cell printed."""
    path = REPO / source
    if not path.is_file():
        raise ProvenanceError(f"{source}: no such committed file")
    if cell is None:
        return path.read_text()
    notebook = json.loads(path.read_text())
    for candidate in notebook["cells"]:
        if candidate.get("id") == cell:
            return "".join(_printed(output) for output in candidate.get("outputs", []))
    raise ProvenanceError(f"{source}: no cell with id {cell}")


def _printed(output: dict) -> str:
    if output.get("output_type") == "stream":
        return "".join(output["text"])
    data = output.get("data", {})
    return "".join(data.get("text/plain", "")) + "\n" if "text/plain" in data else ""


def select_lines(text: str, ranges: str | None) -> str:
    """``ranges`` like ``3-9,14-20`` (1-based, inclusive); ``...`` marks what is left out between two ranges."""
    lines = text.rstrip("\n").split("\n")
    if ranges is None:
        return "\n".join(lines) + "\n"
    picked = []
    for index, part in enumerate(ranges.split(",")):
        first, _, last = part.partition("-")
        first, last = int(first), int(last or first)
        if not 1 <= first <= last <= len(lines):
            raise ProvenanceError(f"lines {part}: the source has {len(lines)} lines")
        if index:
            picked.append("...")
        picked.extend(lines[first - 1 : last])
    return "\n".join(picked) + "\n"


def filled(text: str) -> str:
    """``text`` with every output block's body rewritten from its source."""

    def fill(match: re.Match) -> str:
        body = select_lines(source_text(match["source"], match["cell"]), match["lines"])
        return match["open"] + match["fence"] + body + match["close"]

    return BLOCK.sub(fill, text)


def output_blocks(text: str) -> list[re.Match]:
    return list(BLOCK.finditer(text))


# -- 2. figures -----------------------------------------------------------------------------------------------------


def prose(text: str) -> str:
    """A lesson's text with code blocks (bash, python), inline code, link targets and comments blanked (newlines
    kept, so that line numbers still hold). Generated output blocks are blanked too: they equal their sources by
    construction."""

    def blank(match: re.Match) -> str:
        return re.sub(r"[^\n]", " ", match.group(0))

    for pattern in (BLOCK, CODE_FENCE, LINK_TARGET, INLINE_CODE):
        text = pattern.sub(blank, text)
    return text


def figures(text: str) -> list[tuple[int, str]]:
    """``(line number, figure)`` for each figure in ``text``'s prose: ``95.26%``, ``1.40x``, ``0.5``. A figure right
    after "load" or "load average" (or in a list of them: ``load average 10.4 and 6.9``) is a load average
    (``load 6.9``), sourced by recordings' and notebooks' headers only."""
    found, text = [], prose(text)
    for match in FIGURE.finditer(text):
        value, unit = match.group(1), (match["unit"] or "").strip()
        if unit or "." in value:
            load = "load " if LOAD_BEFORE.search(text[max(0, match.start() - 60) : match.start()]) else ""
            found.append((text.count("\n", 0, match.start()) + 1, load + value + ("x" if unit == "×" else unit)))
    return found


def _key(figure: str) -> str:
    """What must appear in a source: the number, with its percent sign for a percentage (``12%`` is not ``12``)."""
    number = figure.rstrip("x").replace(",", "")
    return number if not number.endswith("%") else number.rstrip("%").strip() + "%"


def sources() -> set[str]:
    """Every number printed into a committed output: notebooks' outputs and the files under results/; a number
    followed by ``%`` also counts as the percentage."""
    # A header's load average is not a measurement: it sources a figure said to be a load ("load 6.9") only.
    texts, loads = [], set()
    for path in (REPO / "results").rglob("*"):
        if _is_source(path):
            text = path.read_text(errors="replace")
            loads |= {f"load {value}" for average in LOAD.findall(text) for value in re.findall(r"[\d.]+", average)}
            texts.append(LOAD.sub("", text))
    for notebook in sorted((REPO / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        printed = "".join(_printed(output) for cell in cells for output in cell.get("outputs", []))
        loads |= {f"load {value}" for average in LOAD.findall(printed) for value in re.findall(r"[\d.]+", average)}
        texts.append(LOAD.sub("", printed))
    found = set(loads)
    for text in texts:
        for match in NUMBER.finditer(text):
            number = match.group(0).replace(",", "")
            found.add(number)
            if text[match.end() : match.end() + 2].lstrip(" ")[:1] == "%":
                found.add(number + "%")
    return found


def _is_source(path: Path) -> bool:
    """A file a run wrote: results/README.md, which people write, sources nothing."""
    return path.is_file() and path.suffix in SOURCE_SUFFIXES and path.name != "README.md"


DERIVED = re.compile(r"^## Derived numbers\n(?P<table>.*?)(?=^## |\Z)", re.DOTALL | re.MULTILINE)
CITATION = re.compile(r"arXiv|https?://|et al\.|\bpaper\b|\bspec\b|documentation|source material", re.IGNORECASE)


def derived_numbers(text: str, printed: set[str]) -> tuple[dict[str, str], list[str]]:
    """The lesson's ``## Derived numbers`` table as {figure: derivation}, and the rows that do not hold: a
    derivation must cite a paper or use only numbers that are themselves printed in a committed output."""
    section = DERIVED.search(text)
    table, problems = {}, []
    if section is None:
        return table, problems
    for row in section["table"].splitlines():
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        if len(cells) < 2 or set(cells[0]) <= set("-: ") or cells[0].lower() == "figure":
            continue
        figure, derivation = cells[0].strip("`"), cells[1]
        if not derivation:
            problems.append(f"{figure}: no derivation")
        elif not CITATION.search(derivation):
            # 1,622 is a measurement too; 1,048,576 and 1,000,000 are units
            grouped = [n.replace(",", "") for n in NUMBER.findall(derivation) if "," in n and "." not in n]
            grouped = [n for n in grouped if not _is_unit(int(n))]
            inputs = [_key(f) for _, f in figures(derivation)] + grouped
            unsourced = [number for number in inputs if number not in printed]
            if not inputs or unsourced:
                problems.append(f"{figure}: derived from {', '.join(unsourced) or 'no printed figure'}")
        table[_key(figure)] = derivation
    return table, problems


def _is_unit(number: int) -> bool:
    """A power of 2 or of 10: a unit's size (1,048,576 bytes in a MiB), not a measurement."""
    while number % 10 == 0 and number > 1:
        number //= 10
    return number & (number - 1) == 0 or number == 1


def unsourced_figures(lesson: Path, printed: set[str] | None = None) -> list[str]:
    """``"line N: figure"`` for each figure of ``lesson`` with no source, then each derived row that does not hold."""
    printed = sources() if printed is None else printed
    text = lesson.read_text()
    derived, problems = derived_numbers(text, printed)
    body = DERIVED.sub(lambda match: "\n" * match.group(0).count("\n"), text)
    missing = [
        f"line {line}: {figure}" for line, figure in figures(body) if _key(figure) not in printed | derived.keys()
    ]
    return missing + [f"derived numbers: {problem}" for problem in problems]


# -- record ---------------------------------------------------------------------------------------------------------


def machine_folder() -> str:
    """results/'s folder for this machine: ``cpu-amd-epyc-2core``, or the first GPU's model (``nvidia-h200``)."""
    import torch

    from common.reports import machine_summary

    if torch.cuda.is_available():  # the folder make gpu-check writes to
        from common.launch import load_script

        gpus = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
        return load_script(REPO / "scripts" / "gpu_check.py").folder_name(gpus)
    cpu = machine_summary().split(",")[0].lower()
    words = [word for word in re.findall(r"[a-z0-9]+", cpu) if word not in {"r", "tm", "processor", "cpu"}]
    cores = len(os.sched_getaffinity(0))
    return "cpu-" + "-".join(words[:2]) + f"-{cores}core"


def record(name: str, command: list[str], timeout: float) -> Path:
    """Run ``command`` from the repository's root; write its output, headed by where and when, to results/."""
    from common.reports import run_header

    header = f"{run_header()}\n$ {shlex.join(command)}\n"  # taken before the run: the load it started under
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0:
        raise ProvenanceError(f"$ {shlex.join(command)} failed ({run.returncode}):\n{run.stderr[-2000:]}")
    path = REPO / "results" / machine_folder() / f"{name}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + run.stdout)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; fail if a quoted output is stale")
    parser.add_argument("--figures", action="store_true", help="list each lesson's figures that have no source")
    parser.add_argument("lessons", nargs="*", type=Path, help="lessons to read (default: all)")
    if sys.argv[1:2] == ["record"]:
        recorder = argparse.ArgumentParser(prog="provenance.py record", usage="%(prog)s NAME [--timeout S] -- COMMAND")
        recorder.add_argument("name", help="the output's file name under results/<machine>/, without .txt")
        recorder.add_argument("--timeout", type=float, default=1800)
        options, command = sys.argv[2:], []
        if "--" in options:  # everything after the first -- is the command, as documented
            options, command = options[: options.index("--")], options[options.index("--") + 1 :]
        args = recorder.parse_args(options)
        if not command:
            recorder.error("give the command after --")
        print(record(args.name, command, args.timeout).relative_to(REPO))
        return 0
    args = parser.parse_args()
    lessons = [path.resolve() for path in args.lessons] or LESSONS
    if args.figures:
        printed = sources()
        total = 0
        for lesson in lessons:
            missing = unsourced_figures(lesson, printed)
            total += len(missing)
            print(f"{lesson.name}: {len(missing)} figure(s) with no source" + "".join(f"\n  {m}" for m in missing))
        return 1 if total else 0
    stale = []
    for lesson in [path.resolve() for path in args.lessons] or QUOTING:
        text = lesson.read_text()
        try:
            new = filled(text)
        except ProvenanceError as error:
            print(f"{lesson.relative_to(REPO)}: {error}")
            return 1
        if new != text:
            stale.append(str(lesson.relative_to(REPO)))
            if not args.check:
                lesson.write_text(new)
    if args.check and stale:
        print(f"quoted outputs differ from their sources in {', '.join(stale)}: run python scripts/provenance.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
