"""Fill ``wheels/`` for a GPU machine without network (scripts/gpu-check.sh installs from it).

The wheels are this checkout's own tested versions, read from the Python that runs this script
(its ``.venv``): flwr, datasets, flwr-datasets, peft, transformers and what they need, less the large
packages a CUDA image already has (torch, numpy, pandas, pyarrow, ...). Run it where pip reaches an
index, for the GPU machine's Python and platform:

    .venv/bin/python scripts/fill_wheels.py --python-version 3.12      # then carry wheels/ there
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path

ROOTS = ("flwr", "datasets", "flwr-datasets", "peft", "transformers", "packaging")
# flwr's server extras (its SuperLink's web stack), which its plain requirements do not name.
EXTRAS = ("sqlalchemy", "greenlet", "uvicorn", "httptools", "uvloop", "watchfiles", "websockets", "python-dotenv")
# On a CUDA image already (docs/deployment.md, "The GPU check"), or large and not needed there (ray, uv).
ON_THE_IMAGE = set(
    "torch numpy pandas pyarrow matplotlib scipy triton sympy networkx jinja2 markupsafe pillow fonttools "
    "kiwisolver contourpy cycler pyparsing python-dateutil six pytz tzdata filelock fsspec mpmath setuptools "
    "ray accelerate psutil tqdm regex aiohttp aiosignal frozenlist multidict yarl propcache attrs "
    "aiohappyeyeballs idna charset-normalizer urllib3 certifi requests httpcore h11 anyio sniffio "
    "typing-extensions pyyaml hf-xet seaborn uv".split()
)
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (5, 17, 24, 27, 28, 31, 34)]
PLATFORMS += ["manylinux2014_x86_64", "manylinux1_x86_64"]


def pinned_closure() -> list[str]:
    """``name==version`` of ROOTS, EXTRAS and everything they require here, less ON_THE_IMAGE."""
    norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
    seen: dict[str, str] = {}
    stack = [*ROOTS, *EXTRAS]
    while stack:
        name = norm(stack.pop())
        if name in seen or name in ON_THE_IMAGE:
            continue
        try:
            seen[name] = version(name)
        except PackageNotFoundError:
            continue
        stack += [re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in requires(name) or [] if "extra ==" not in r]
    return [f"{n}=={v}" for n, v in sorted(seen.items())]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    parser.add_argument("--dest", type=Path, default=Path(__file__).resolve().parent.parent / "wheels")
    args = parser.parse_args()
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(args.dest), "--no-deps",
           "--only-binary=:all:", "--implementation", "cp", "--python-version", args.python_version,
           *[f"--platform={p}" for p in PLATFORMS], "--platform=any", *pinned_closure()]  # fmt: skip
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
