"""The Flower app on disk: find its folder, read its run-config keys, check overrides against them.

The project's commands (``parablock-flwr simulate`` / ``deploy``) check every
``KEY=VALUE`` override here, before any Flower process starts: an unknown key
(with the closest valid one) or a value of the wrong type is one line and exit
code 2. Value ranges are the ServerApp's to check (``parablock_flwr/config.py``).
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import logging
import tomllib
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)


class ProjectNotFound(RuntimeError):
    """No folder from the start upwards holds a Flower app."""


class OverrideError(ValueError):
    """A run-config override that the app cannot take; the message is one line."""


def has_flower_app(pyproject: Path) -> bool:
    """Does this pyproject.toml declare a Flower app (a ``[tool.flwr.app]`` table)?"""
    try:
        data = tomllib.loads(Path(pyproject).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    return isinstance(data.get("tool", {}).get("flwr", {}).get("app"), dict)


def find_project_dir(start: Path | None = None) -> Path:
    """The nearest folder, from ``start`` (default: the working directory) upwards, whose
    pyproject.toml has ``[tool.flwr.app]``: the folder ``flwr run`` is given."""
    here = Path(start if start is not None else Path.cwd()).expanduser().resolve()
    for folder in (here, *here.parents):
        if has_flower_app(folder / "pyproject.toml"):
            return folder
    raise ProjectNotFound(
        f"no Flower app in {here} or above it: expected a folder whose pyproject.toml has "
        "[tool.flwr.app]; run from the project's folder or name it (--app-dir)"
    )


def app_config(app_dir: Path) -> dict[str, object]:
    """The app's run-config keys and their defaults: ``[tool.flwr.app.config]``."""
    data = tomllib.loads((Path(app_dir) / "pyproject.toml").read_text())
    return dict(data.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {}))


def parse_overrides(items: list[str]) -> dict[str, object]:
    """``KEY=VALUE`` arguments in TOML syntax (strings quoted), in order, later ones winning."""
    config: dict[str, object] = {}
    for item in items:
        try:
            config.update(tomllib.loads(item))
        except tomllib.TOMLDecodeError as err:
            raise OverrideError(f"{item!r}: expected KEY=VALUE in TOML syntax, strings quoted ({err})") from None
    return config


def toml_value(value: object) -> str:
    """A value as it is written in a TOML file (and on the command line)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):  # a basic string: JSON's escapes are TOML's, and DEL must be escaped too
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    return json.dumps(value, default=str)


def _expected(default: object, value: object) -> str | None:
    """What the key's type needs, if ``value`` is not of it (an int is a valid float)."""
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "true or false"
    if isinstance(default, int):
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if isinstance(default, float):
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    if isinstance(default, str):
        return None if isinstance(value, str) else "a string (in double quotes)"
    return None  # a type the app does not use: leave it to the ServerApp


def check_overrides(overrides: Mapping[str, object], defaults: Mapping[str, object]) -> None:
    """Raise ``OverrideError`` (one line) at the first unknown key or wrongly typed value."""
    for key, value in overrides.items():
        if key not in defaults:
            close = difflib.get_close_matches(key, list(defaults), n=1)
            hint = f"did you mean {close[0]}?" if close else "docs/configuration.md lists the keys"
            raise OverrideError(f"{key}: unknown key; {hint}")
        expected = _expected(defaults[key], value)
        if expected is not None:
            raise OverrideError(f"{key}={toml_value(value)}: expected {expected}")


def strategy_problem(strategy: object, app_dir: Path) -> str | None:
    """Why the ServerApp could not import ``strategy = "package.module:Class"``, in one line, or None. Flower
    runs the app from the bundle it builds of the app folder (``fab-include``: ``parablock_flwr/`` and
    ``extensions/``), so a module is found there or among what this environment has installed; a folder of
    its own beside them is left out of the bundle (docs/extending.md)."""
    if not isinstance(strategy, str) or not strategy:
        return None
    module = strategy.partition(":")[0]
    top, app_dir = module.split(".")[0], Path(app_dir)
    if top == "parablock_flwr":
        if importlib.util.find_spec(module) is None:
            return f"strategy={strategy!r}: no module {module!r} in this package; expected 'package.module:Class'"
        return None
    where = app_dir.joinpath(*module.split("."))
    if top == "extensions":
        if where.with_suffix(".py").is_file() or (where / "__init__.py").is_file():
            return None
        return f"strategy={strategy!r}: no {where.relative_to(app_dir)}.py in {app_dir}; expected your module there"
    if (app_dir / top).is_dir() or (app_dir / f"{top}.py").is_file():
        return (f"strategy={strategy!r}: {top} is in the app folder but not in the bundle Flower runs (only "
                f"parablock_flwr/ and extensions/); move it into {app_dir / 'extensions'}/ and name it "
                f"'extensions.{strategy}'")  # fmt: skip
    if importlib.util.find_spec(top) is not None:  # installed: the ServerApp imports it from its environment
        return None
    return (f"strategy={strategy!r}: no module {top!r} in {app_dir / 'extensions'}/ nor installed here; put it in "
            f"extensions/ (it ships with the app) or install it where the ServerApp runs")  # fmt: skip
