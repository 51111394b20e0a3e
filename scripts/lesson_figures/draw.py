"""Drawing helpers the lessons' figures share: boxes, arrows, and a save that writes the same bytes every time."""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results" / "cpu-amd-epyc-2core"

# One palette for the whole course: a rank, a chunk or a phase keeps its colour from lesson to lesson.
RANK_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7")
COMPUTE, COMMUNICATE, IDLE, MEMORY = "#9ecae1", "#fdae6b", "#e0e0e0", "#a1d99b"


def canvas(width: float, height: float, xlim: float = 10, ylim: float = 6):
    """A figure with one axes of data coordinates 0..xlim, 0..ylim and no frame: the stage for a diagram."""
    fig, axes = plt.subplots(figsize=(width, height))
    axes.set_xlim(0, xlim)
    axes.set_ylim(0, ylim)
    axes.axis("off")
    return fig, axes


def box(axes, x, y, width, height, text, colour, fontsize=10, **text_style):
    """A rounded box with centred text; returns nothing, draws on ``axes`` in data coordinates."""
    axes.add_patch(FancyBboxPatch((x, y), width, height, boxstyle="round,pad=0.02", fc=colour, ec="black", lw=1))
    axes.text(x + width / 2, y + height / 2, text, ha="center", va="center", fontsize=fontsize, **text_style)


def arrow(axes, start, end, colour="black", text=None, fontsize=9, style="->", **text_style):
    """An arrow from ``start`` to ``end`` (data coordinates), with optional text at its middle."""
    axes.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": style, "color": colour, "lw": 1.4})
    if text:
        middle = ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2)
        axes.text(*middle, text, ha="center", va="center", fontsize=fontsize, color=colour, **text_style)


def save(fig, path: Path) -> None:
    """Write ``fig`` as a PNG with no date or version in its metadata, so a redraw gives the same file."""
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def save_with_rank_legend(fig, path: Path, labels: list[str], title: str) -> None:
    """A legend under the panels, one rank's colour per label (rank 0 first), the figure's title, then ``save``."""
    handles = [plt.Rectangle((0, 0), 1, 1, color=RANK_COLOURS[rank]) for rank in range(len(labels))]
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    save(fig, path)


def tint(colour: str, amount: float = 0.6) -> tuple:
    """``colour`` mixed with white: ``amount`` 0 keeps it, 1 gives white."""
    return tuple(c + (1 - c) * amount for c in to_rgb(colour))


def printed_by_cell(notebook: Path, cell_id: str) -> str:
    """What one cell of a committed notebook printed (its stream outputs)."""
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell.get("id") == cell_id:
            return "".join("".join(out["text"]) for out in cell.get("outputs", []) if out["output_type"] == "stream")
    raise KeyError(cell_id)
