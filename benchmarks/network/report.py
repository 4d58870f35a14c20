"""docs/results/network.md: what ran, where, with which command, then the tables and plots."""

from __future__ import annotations

import shutil
from pathlib import Path

from benchmarks.common import PROJECT_DIR, write_report

TITLE = "Shaped links: every algorithm over rate-limited, delayed links"


def write_docs(results: dict, pngs: list[Path]) -> Path:
    """docs/results/network.md, whole, and the plots under docs/img/ (network-*.png)."""
    img = PROJECT_DIR / "docs" / "img"
    img.mkdir(parents=True, exist_ok=True)
    links = []
    for png in pngs:
        shutil.copy(png, img / f"network-{png.name}")
        links.append(f"![{png.stem}](../img/network-{png.name})")
    return write_report("network", TITLE, describe(results) + "\n\n" + "\n\n".join(links), how=results["command"])


def describe(results: dict) -> str:
    """The section's text: what ran, where, with which command, then the tables."""
    s = results["settings"]
    return (
        f"Model `{s['model_label']}`, {s['clients']} clients (each a SuperNode with a node worker, 1 torch "
        f"thread, in its own network namespace), {s['rounds']} rounds, {s['layers_per_block']} layers per block, "
        f"{s['local_steps']} local steps; links of {', '.join(f'{r:g}' for r in s['rates_mbps'])} Mbit/s each way "
        f"(`tc tbf` on both ends of a veth pair) with {s['latency_ms']:g} ms one way (user-space proxy). The "
        f"server's time model was given the same link (`modeled_*`). The default rate is the one at which the "
        f"link time of a round equals its compute (how it was chosen: `python -m benchmarks.network --help`; "
        f"`--probe` measures it on another machine).\n\n"
        "compute = mean over nodes of the worker's compute of the round's update; comm = the node's window "
        "from its previous reply leaving the worker to this round's message reaching it (includes Flower's "
        "polling, serialization and the server's aggregation and evaluation; none in round 1); idle = the "
        "part of that window in which the worker computed nothing; round wall = the server's round, from "
        "sending the messages to the end of its held-out evaluation; overlap eff. = round wall / "
        "max(compute, comm), 1.0 is "
        "perfect overlap; wire MB = bytes that crossed each node's veth during the whole run (all rounds and "
        "Flower's polls).\n\n" + results["tables"]
    )
