"""Fixtures (a tiny real Llama with a locally trained tokenizer; TLS files for the stream), and the check that
every test that starts Flower processes is marked `e2e`. What tests import is in helpers.py."""

from __future__ import annotations

import inspect
import types
from pathlib import Path

import pytest

from parablock_flwr.tools.credentials import make_tls
from parablock_flwr.tools.tiny_model import build_tiny_model

from helpers import STARTS_FLOWER


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tls(tmp_path_factory):
    """A CA, a server certificate for localhost and a client certificate (``make_tls``), read-only to tests."""
    return make_tls(tmp_path_factory.mktemp("tls"))


def _names(code: types.CodeType) -> set[str]:
    """Global names a function's code (its lambdas, comprehensions and inner functions included) uses."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def starts_flower(func, depth: int = 3, seen: set | None = None) -> bool:
    """Does ``func`` call one of helpers.STARTS_FLOWER, directly or through functions of its own module?"""
    func = inspect.unwrap(func)
    code, module_globals = getattr(func, "__code__", None), getattr(func, "__globals__", {})
    if code is None:
        return False
    seen = set() if seen is None else seen
    seen.add(func)
    for name in _names(code):
        obj = module_globals.get(name)
        if any(obj is starter for starter in STARTS_FLOWER):
            return True
        if (
            depth
            and inspect.isfunction(obj)
            and obj not in seen
            and obj.__module__ == func.__module__
            and starts_flower(obj, depth - 1, seen)
        ):
            return True
    return False


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Every test that starts Flower processes (its function or one of its fixtures calls a function of
    helpers.STARTS_FLOWER) carries the `e2e` marker, written on it: the fast tier
    (`-m "not e2e and not netns and not slow"`) then cannot start one by mistake. A test that starts Flower
    without it stops the collection, naming it."""
    unmarked = []
    for item in items:
        if item.get_closest_marker("e2e") is not None or not hasattr(item, "function"):
            continue
        fixtures = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        funcs = [item.function] + [d.func for defs in fixtures.values() for d in defs]
        if any(starts_flower(f) for f in funcs):
            unmarked.append(item.nodeid)
    if unmarked:
        raise pytest.UsageError(f"these tests start Flower processes; mark them @pytest.mark.e2e: {unmarked}")
