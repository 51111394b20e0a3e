#!/usr/bin/env python3
# A copy of ../shared/tools/prose_metrics.py (the course style guide's measure), kept in the repository so that
# tests/test_lessons.py can hold the rewritten lessons to STYLE.md's targets in CI, where ../shared is absent.
"""Prose metrics of Markdown lessons: what a reader meets between the code blocks and tables.

    python3 prose_metrics.py FILE.md ...        one row per file, then the median of the rows

Counted on prose only (fenced code, tables, headings, HTML, images and math blocks removed): sentences, words per
sentence (median, 90th percentile), share of sentences over 40 words, parentheses and semicolons per sentence,
inline code spans per 100 words, test citations (``tests/...``) per 1,000 words of prose. The lines of a
"Checked by" list (evidence kept apart from the story) are not prose.
"""

import re
import statistics
import sys


def without_evidence_lists(text: str) -> str:
    """Drop each "Checked by" list (the line that names it and the list items under it): evidence kept apart."""
    out, skipping = [], False
    for line in text.splitlines():
        if "checked by" in line.lower() and len(line) < 200 and not line.startswith(("```", "    ")):
            skipping = True
            out.append("")
            continue
        if skipping and (line.strip().startswith(("-", "*")) or line.startswith("  ") and line.strip()):
            out.append("")
            continue
        skipping = False
        out.append(line)
    return "\n".join(out)


def prose(text: str) -> str:
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"\$\$.*?\$\$", " ", text, flags=re.S)
    text = re.sub(r"<[^>]+>", " ", text)
    keep = []
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith(("|", "#", "![", "    ")) or line.startswith("    "):
            keep.append("")
            continue
        keep.append(s.lstrip("-*> ").strip())
    return "\n".join(keep)


def sentences(text: str) -> list[str]:
    paragraphs = re.split(r"\n\s*\n", text)
    out = []
    for p in paragraphs:
        p = " ".join(p.split())
        if not p:
            continue
        # protect inline code and common abbreviations from the splitter
        p = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(".", "\u2024"), p)
        p = re.sub(r"\b(e\.g|i\.e|vs|etc|cf|Fig|al)\.", lambda m: m.group(0).replace(".", "\u2024"), p)
        for s in re.split(r"(?<=[.!?])\s+(?=[A-Z0-9`*(\[])", p):
            if len(s.split()) >= 3:
                out.append(s)
    return out


def metrics(path: str) -> dict:
    raw = open(path, encoding="utf-8").read()
    ss = sentences(prose(without_evidence_lists(raw)))
    lengths = [len(s.split()) for s in ss]
    words = sum(lengths) or 1
    n = len(ss) or 1
    return {
        "file": path.rsplit("/", 1)[-1][:34],
        "sentences": len(ss),
        "w/sent med": statistics.median(lengths) if lengths else 0,
        "w/sent p90": sorted(lengths)[int(0.9 * (len(lengths) - 1))] if lengths else 0,
        "% >40w": 100 * sum(x > 40 for x in lengths) / n,
        "paren/sent": sum(s.count("(") for s in ss) / n,
        "semi/sent": sum(s.count(";") for s in ss) / n,
        "code/100w": 100 * sum(s.count("`") // 2 for s in ss) / words,
        "tests/1kw": 1000 * sum(len(re.findall(r"tests/[\w/]+[.\u2024]py", s)) for s in ss) / words,
    }


def main(paths):
    rows = [metrics(p) for p in paths]
    keys = list(rows[0])
    print(" | ".join(f"{k:>11}" if k != "file" else f"{k:<34}" for k in keys))
    for r in rows:
        print(
            " | ".join(
                f"{r[k]:<34}" if k == "file" else f"{r[k]:>11.1f}" if isinstance(r[k], float) else f"{r[k]:>11}"
                for k in keys
            )
        )
    if len(rows) > 1:
        med = {k: statistics.median(r[k] for r in rows) for k in keys if k != "file"}
        print(" | ".join([f"{'median':<34}"] + [f"{med[k]:>11.1f}" for k in keys if k != "file"]))


if __name__ == "__main__":
    main(sys.argv[1:])
