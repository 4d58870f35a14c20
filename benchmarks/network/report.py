"""docs/results/network.md: what ran, where, with which command, then the tables and plots."""

from __future__ import annotations

import shutil
from pathlib import Path

from benchmarks.common import PROJECT_DIR, write_report

TITLE = "Shaped links: every algorithm over rate-limited, delayed links"


def write_docs(results: dict, pngs: list[Path]) -> Path:
    """docs/results/network.md, whole, and the plots under docs/img/ (network-*.png)."""
    links = copy_plots(pngs, "network")
    return write_report(
        "network", TITLE, describe(results) + "\n\n" + "\n\n".join(links), how=results["command"], measured=results
    )


def copy_plots(pngs: list[Path], prefix: str) -> list[str]:
    """The plots copied under docs/img/ as ``PREFIX-NAME.png``; their Markdown links from docs/results/."""
    img = PROJECT_DIR / "docs" / "img"
    img.mkdir(parents=True, exist_ok=True)
    links = []
    for png in pngs:
        shutil.copy(png, img / f"{prefix}-{png.name}")
        links.append(f"![{png.stem}](../img/{prefix}-{png.name})")
    return links


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


DIRECT_TITLE = "The direct transport on a shaped link: issue 32's targets, Flower's path beside the stream"


def write_direct_docs(results: dict, pngs: list[Path]) -> Path:
    """docs/results/network-direct.md (``--transports`` with direct): the set-up, issue 32's targets, every
    round; the plots under docs/img/ (network-direct-*.png). docs/results/network.md stays as it is."""
    links = copy_plots(pngs, "network-direct")
    s = results["settings"]
    setup = (
        f"Transports side by side: {', '.join(s['transports'])}. On `direct` the block records move on the run's "
        "own gRPC stream, plaintext like the benchmark's SuperLink (`--insecure`; no TLS in this benchmark): "
        "the ServerApp serves it on port 9097 of the link's namespace, and each node reaches it through a "
        "second latency proxy in its namespace, at the address the run config names (127.0.0.1:9097), over "
        "the same shaped link as its Flower traffic. "
        + (
            "Separated cores: the worker's compute thread on CPU 1, every other process (the worker's "
            "stream and socket threads included) on CPU 0; the server evaluates at rounds 0 and R only. "
            if s.get("separate_cores")
            else ""
        )
        + "The control floor: benchmarks/flower_floor.py's app (no model, no payload) over the same links and "
        "processes. On a shared 2-core machine the seconds are noisy; the load is given per floor run."
    )
    text = setup + "\n\n" + results.get("targets", "") + "\n\nEvery round:\n\n" + describe(results)
    text += "\n\n" + "\n\n".join(links)
    return write_report("network-direct", DIRECT_TITLE, text, how=results["command"], measured=results)
