"""The picture of a drafter comparison, shared by `specdec demo` and bench/accept_rate.py: per drafter the
acceptance at each draft position, and the speedup over plain decoding with the drafter's tau.

Needs matplotlib (`pip install 'specdec[bench]'`); `available()` says whether it is installed. The numbers drawn
are also written into the PNG's text chunk `specdec` as JSON (`read_numbers`), so a picture can be checked
against the run that measured it.
"""

from __future__ import annotations

import importlib.util
import json
import textwrap

KEYS = ("per_position", "tau", "speedup")  # what the picture shows of each drafter
MISSING = "matplotlib is not installed (pip install 'specdec[bench]', or pip install matplotlib)"
TEXT_KEY = "specdec"  # the PNG text chunk that holds the numbers drawn


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def numbers(drafters: dict[str, dict]) -> dict[str, dict]:
    """The numbers the picture draws: per drafter (in the given order) `KEYS` of its record; `per_position[i]` is
    the acceptance at draft position i + 1 (a tree's depth i + 1) given the drafts before it were accepted, listed
    only for positions some round reached."""
    return {name: {k: r[k] for k in KEYS} for name, r in drafters.items()}


def figure(drafters: dict[str, dict], title: str):
    """A matplotlib Figure of `numbers(drafters)`: left, acceptance per draft position (one line per drafter over
    the positions it reached); right, one horizontal bar per drafter of its speedup over plain decoding (the
    dashed line is plain decoding, 1x), labelled with the speedup and tau (tokens per verify forward). Speedups are
    ratios of paths timed together; tokens/s would also carry the machine's load at each drafter's turn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = numbers(drafters)
    names = list(data)
    fig, (pos_ax, speed_ax) = plt.subplots(1, 2, figsize=(12, 2.6 + 0.45 * max(len(names), 4)),
                                           gridspec_kw={"width_ratios": [1, 1.1]})
    width = max((len(d["per_position"]) for d in data.values()), default=0)
    for i, (name, d) in enumerate(data.items()):
        pos = d["per_position"]
        pos_ax.plot(range(1, len(pos) + 1), pos, marker="o", color=f"C{i}", label=name)
    pos_ax.set_xticks(range(1, width + 1))
    pos_ax.set_xlim(0.5, max(width, 1) + 0.5)
    pos_ax.set_ylim(0, 1.05)
    pos_ax.grid(alpha=0.3)
    pos_ax.set_xlabel("draft position (tree: depth)")
    pos_ax.set_ylabel("acceptance, given the drafts before it accepted")
    pos_ax.set_title("acceptance per draft position")
    if names:
        pos_ax.legend(loc="lower left", fontsize=8, framealpha=0.9)

    speedups = [data[n]["speedup"] for n in names]
    bars = speed_ax.barh(range(len(names)), speedups, color=[f"C{i}" for i in range(len(names))])
    speed_ax.set_yticks(range(len(names)), names)
    speed_ax.invert_yaxis()  # the first drafter on top, as in the legend
    speed_ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    top = max(speedups + [1.0])
    speed_ax.set_xlim(0, top * 1.6)  # room for the labels right of the bars
    for bar, name in zip(bars, names):
        d = data[name]
        speed_ax.annotate(f" {d['speedup']:.2f}x  (tau {d['tau']:.2f})",
                          (bar.get_width(), bar.get_y() + bar.get_height() / 2), va="center", fontsize=8)
    speed_ax.set_xlabel("speedup over plain decoding (dashed: plain, 1x)")
    speed_ax.set_title("speed per drafter")
    fig.suptitle(textwrap.fill(title, 150), fontsize=9)
    fig.tight_layout()
    return fig


def write(drafters: dict[str, dict], path: str, title: str) -> None:
    """`figure(drafters, title)` saved as a PNG at `path`, with `numbers(drafters)` in its text chunk."""
    import matplotlib.pyplot as plt

    fig = figure(drafters, title)
    fig.savefig(path, dpi=120, metadata={TEXT_KEY: json.dumps(numbers(drafters))})
    plt.close(fig)


def read_numbers(path: str) -> dict[str, dict]:
    """The numbers `write` put into the PNG at `path`."""
    from PIL import Image

    with Image.open(path) as im:
        return json.loads(im.text[TEXT_KEY])
