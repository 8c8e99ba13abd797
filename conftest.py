"""What pytest loads in this checkout, for the project's own suite and for a user's run alike.

pytest loads this file for any session whose rootdir is the checkout: the project's suite
(``python -m pytest -m local``, ``pytest tests/test_x.py``) and a user's ``pytest --pyargs
pytest_ppsmoke.spec`` started here, which must run with the main install only (no pytest-xdist,
pytest-asyncio or hypothesis). So this file holds no fixture and imports nothing beyond pytest;
for the suite alone (a session not started with ``--pyargs``) it

- registers the suite's session plugin, ``tests/suite.py`` (its models, tinygrad's device, the
  check that no process is left behind), after checking that the dev tools it needs are here;
- runs the test files on two workers more than the cores, each file on one worker, in the order
  ``tests/suite.py`` sorts them (``-n auto --dist loadfile --no-loadscope-reorder``), unless the
  command line says ``-n`` itself (``-n 0``: in this process);
- runs the shipped spec as the suite runs it (:data:`SUITE_SETTINGS`), where neither the command
  line nor the option's environment variable says otherwise.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Generator

import pytest

pytest_plugins = ["pytester"]  # pytest's own: the plugin's tests run inner sessions with it

DEV_TOOLS = ("xdist", "pytest_asyncio", "hypothesis")  # what the suite imports that the main install lacks
DEV_INSTALL = "pip install -c constraints.txt -e '.[dev]'"
ASYNCIO_INI = ("asyncio_mode", "asyncio_default_fixture_loop_scope")  # pyproject.toml's keys for pytest-asyncio

# The suite's run of the spec tests: local, since a VAST_API_KEY in a developer's environment must
# not rent GPUs for the suite; 24 tokens, since the claims hold at any length and CPU decode is
# slow. Not pyproject.toml's ini keys: a user's run from this folder would read those too.
SUITE_SETTINGS = {"mode": "local", "max_tokens": "24"}


def own_suite(config: pytest.Config) -> bool:
    """Whether the session is the project's suite, not a user's run of the shipped spec."""
    return not config.option.pyargs


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    # Without pytest-asyncio its ini keys in pyproject.toml are unknown: pytest would warn on
    # every run of the spec from here. Declared, they are read by nothing.
    if not pluginmanager.has_plugin("asyncio"):
        for name in ASYNCIO_INI:
            parser.addini(name, "pytest-asyncio's (a dev tool): the suite's async tests")


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config: pytest.Config) -> Generator[None, object, object]:
    if own_suite(config) and config.pluginmanager.has_plugin("ppsmoke"):
        from pytest_ppsmoke.harness.settings import OPTIONS  # the table only (standard library)

        env = {o.name: o.env for o in OPTIONS}
        for name, value in SUITE_SETTINGS.items():
            dest = f"ppsmoke_{name}"
            if getattr(config.option, dest, None) is None and not (env[name] and env[name] in os.environ):
                setattr(config.option, dest, value)
    # before xdist's own hook, which turns -n into its workers (a worker's config says -n nothing
    # again, and has workerinput: it must not start workers of its own)
    if (
        own_suite(config)
        and config.pluginmanager.has_plugin("xdist")
        and not hasattr(config, "workerinput")
        and config.option.numprocesses is None
    ):
        config.option.numprocesses = "auto"
        if config.option.dist == "no":
            config.option.dist = "loadfile"
        config.option.loadscopereorder = False
    return (yield)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: the main install has no xdist
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two workers more than the cores. Many tests mostly wait (a node's boot, a SWIM
    timeout, a rate limit's penalty, an emulated network's delay), and a worker that waits leaves
    its core to the others (on 2 cores, in the same state: 325 s with 4 workers, 390 s with 3)."""
    return (os.cpu_count() or 1) + 2


def pytest_configure(config: pytest.Config) -> None:
    if not own_suite(config):
        return
    missing = [name for name in DEV_TOOLS if importlib.util.find_spec(name) is None]
    if missing:
        raise pytest.UsageError(
            f"the project's suite needs the dev install ({', '.join(missing)} missing): {DEV_INSTALL}; "
            "the shipped spec runs without it: pytest --pyargs pytest_ppsmoke.spec"
        )
    config.pluginmanager.import_plugin("tests.suite")
