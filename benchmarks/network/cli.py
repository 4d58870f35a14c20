"""The command line: arguments, their validation (one line naming the bad value) and defaults."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks.common import PROJECT_DIR

# Chosen so that link time ~ one round's compute: see the module docstring.
DEFAULT_RATE_MBPS = 40.0
DEFAULT_LATENCY_MS = 50.0
FAST_RATE_MBPS = 8.0
FAST_LATENCY_MS = 20.0


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + message; one line is enough
        sys.exit(f"network: {message}")


def _positive(kind: type):
    """An argparse type: an int or float > 0."""
    expected = f"expected {'an integer' if kind is int else 'a number'} > 0"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {expected}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r}: {expected}")
        return value

    return parse


def rates(text: str) -> list[float]:
    """An argparse type: a comma list of rates > 0."""
    return [_positive(float)(part) for part in text.split(",")]


def algorithm_names() -> tuple[str, ...]:
    """What the project's config accepts now (imported late: it imports torch, ~4 s, not needed for --help)."""
    from parablock_flwr.config import ALGORITHMS

    return ALGORITHMS


def _comma_list(choices_name: str):
    """An argparse type: a comma list of names from ``parablock_flwr.config.<choices_name>`` (read when parsing:
    the config imports torch), each once, in order."""

    def parse(text: str) -> list[str]:
        import parablock_flwr.config as config

        choices = getattr(config, choices_name)
        names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
        for name in names or [text]:
            if name not in choices:
                raise argparse.ArgumentTypeError(f"{name!r}: expected a comma list of {', '.join(choices)}")
        return names

    return parse


_algorithms, _transfer_dtypes, _transports = map(_comma_list, ("ALGORITHMS", "TRANSFER_DTYPES", "TRANSPORTS"))


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number >= 0")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import benchmarks.network

    p = OneLineParser(
        prog="python -m benchmarks.network",
        description=benchmarks.network.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--rate",
        type=_positive(float),
        help=f"link rate each way, Mbit/s (default {DEFAULT_RATE_MBPS:g}; --fast {FAST_RATE_MBPS:g})",
    )
    p.add_argument("--rates", type=rates, help="a sweep: comma list of link rates, Mbit/s (e.g. 10,25,100)")
    p.add_argument(
        "--latency-ms",
        type=_non_negative,
        help=f"one-way latency (default {DEFAULT_LATENCY_MS:g}; --fast {FAST_LATENCY_MS:g})",
    )
    p.add_argument("--clients", type=_positive(int), help="SuperNodes, each with a worker (default 2)")
    p.add_argument(
        "--model", help="embedded:<name>, HF id or folder (default: the embedded SmolLM2; --fast: a tiny Llama)"
    )
    p.add_argument("--layers-per-block", type=_positive(int), help="default 5 (--fast 2)")
    p.add_argument("--local-steps", type=_positive(int), help="default 3")
    p.add_argument("--rounds", type=_positive(int), help="default 3")
    p.add_argument(
        "--algorithms", type=_algorithms, help="comma list (default: every name in parablock_flwr.config.ALGORITHMS)"
    )
    p.add_argument("--out", type=Path, help="output folder (default runs/network-<date-time> in the project)")
    p.add_argument("--fast", action="store_true", help="tiny model, 2 clients, 3 rounds: a short smoke run")
    docs = p.add_mutually_exclusive_group()
    docs.add_argument("--docs", action="store_true", help="write docs/results/ even with --fast")
    docs.add_argument("--no-docs", action="store_true", help="leave docs/ alone")
    p.add_argument(
        "--probe",
        action="store_true",
        help="run 1 round of the first algorithm and print the rate at which link time = compute",
    )
    p.add_argument(
        "--transfer-dtypes",
        type=_transfer_dtypes,
        help="a sweep of every rate x these dtypes (e.g. fp32,bf16,int8) over one set of processes: the window "
        "against the rate for each dtype, and the time model calibrated on two points, checked on the rest",
    )
    p.add_argument(
        "--transports",
        type=_transports,
        help="comma list of how a block's bytes travel (default flower): each algorithm runs on each, side by "
        "side; direct: the run's own stream (plaintext, as the SuperLink), through a second latency proxy per "
        "node; with direct, writes docs/results/network-direct.md with issue 32's targets",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also run Flower's control floor at each rate (the Flower-only app, no payload), for the targets",
    )
    p.add_argument(
        "--separate-cores",
        action="store_true",
        help="the workers' compute threads on CPU 1, every other process on CPU 0, and the server evaluating at "
        "rounds 0 and R only (benchmarks.window's set-up: with one client, what overlap can gain on 2 cores)",
    )
    p.add_argument("--report", type=Path, help="run nothing: the tables and docs again from this results.json")
    p.add_argument("--timeout-s", type=_positive(float), default=7200.0, help="limit for each `flwr run`")
    args = p.parse_args(argv)
    if args.transfer_dtypes and args.transports and args.transports != ["flower"]:
        p.error(f"--transports={','.join(args.transports)} with --transfer-dtypes: expected the sweep on flower only")
    if args.rate is not None and args.rates is not None:
        p.error(f"--rate={args.rate:g} and --rates={','.join(f'{r:g}' for r in args.rates)}: expected only one")
    if args.clients is not None and args.clients > 250:
        p.error(f"--clients={args.clients}: expected at most 250 (one /30 subnet per node in 10.213.0.0/16)")
    _defaults(args)
    return args


def _defaults(args: argparse.Namespace) -> None:
    """Fill what was not given: the defaults, or --fast's."""
    fast = args.fast
    args.tiny = args.model is None and fast
    args.rates = args.rates or [args.rate or (FAST_RATE_MBPS if fast else DEFAULT_RATE_MBPS)]
    if args.latency_ms is None:
        args.latency_ms = FAST_LATENCY_MS if fast else DEFAULT_LATENCY_MS
    args.clients = args.clients or 2
    args.layers_per_block = args.layers_per_block or (2 if fast else 5)
    args.local_steps = args.local_steps or 3
    args.rounds = args.rounds or (1 if args.probe else 3)
    args.algorithms = args.algorithms or list(algorithm_names())
    args.transports = args.transports or ["flower"]
    if args.separate_cores:
        args.compute_cpus = "1"
        args.extra_config = {"eval-every": args.rounds, "generate-examples": 0}
    if args.probe:
        args.algorithms = args.algorithms[:1]
    args.write_docs = not args.no_docs and not args.probe and (args.docs or not fast)
    args.out = (args.out or PROJECT_DIR / "runs" / f"network-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
