"""The install's torch floor is transformers' own: scripts/check_torch.py (run by scripts/install.sh) and
pyproject.toml name the minimum that the installed transformers enforces, and the check fails, naming the
fix, for a torch that transformers would disable."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.version import Version

from parablock_flwr.tools.app_config import find_project_dir

PROJECT_DIR = find_project_dir(Path(__file__).resolve().parent)
CHECK = PROJECT_DIR / "scripts" / "check_torch.py"


def transformers_torch_minimum() -> Version:
    """The version ``transformers.utils.is_torch_available`` compares the installed torch with."""
    from transformers.utils import import_utils

    source = inspect.getsource(inspect.unwrap(import_utils.is_torch_available))
    floors = set(re.findall(r"version\.parse\(\"([0-9.]+)\"\)", source))
    assert len(floors) == 1, f"expected one minimum in is_torch_available, found {sorted(floors)}"
    return Version(floors.pop())


def check_script_minimum() -> Version:
    return Version(re.search(r'^TORCH_MIN = "([0-9.]+)"', CHECK.read_text(), re.M).group(1))


def test_install_check_and_pyproject_name_transformers_torch_minimum():
    want = transformers_torch_minimum()
    assert check_script_minimum() == want
    deps = tomllib.loads((PROJECT_DIR / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_dep = next(d for d in deps if re.match(r"torch\b", d))
    assert Version(re.search(r">=\s*([0-9.]+)", torch_dep).group(1)) == want, torch_dep
    assert "check_torch.py" in (PROJECT_DIR / "scripts" / "install.sh").read_text()


def test_documented_cuda_torch_is_one_transformers_accepts():
    want = transformers_torch_minimum()
    for doc in (
        "docs/usage.md",
        "docs/deployment.md",
        "docs/deploy-8b.md",
        "scripts/install.sh",
        "scripts/check_torch.py",
    ):
        pins = re.findall(r"TORCH_SPEC=\"torch==([0-9.]+)", (PROJECT_DIR / doc).read_text())
        assert all(Version(p) >= want for p in pins), f"{doc}: TORCH_SPEC pins {pins}; transformers needs >= {want}"


def run_check(pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (pythonpath, env.get("PYTHONPATH"))))
    return subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, env=env, timeout=120)


def test_check_passes_for_the_installed_torch():
    done = run_check()
    assert done.returncode == 0, done.stderr


def test_check_fails_naming_the_fix_for_a_torch_transformers_disables(tmp_path):
    # The distribution metadata importlib finds first says torch 2.5.1, as a site's older CUDA build would.
    info = tmp_path / "torch-2.5.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.5.1\n")
    done = run_check(str(tmp_path))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "torch 2.5.1 is installed" in lines[0] and f'TORCH_SPEC="torch>={check_script_minimum()}"' in lines[0]
