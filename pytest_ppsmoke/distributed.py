"""The pytest plugin under pytest-xdist: every test that uses the deployment runs in one worker.

A deployment lives in the process that rented it: its seed node (the orchestrator's iroh
endpoint), its vast.ai client and, in local mode, the emulator whose children the nodes are.
Another worker process cannot use it, and a session-scoped fixture is set up once per worker
that needs it: spread over two workers, the deployment's tests would rent twice (on vast.ai,
twice the bill). So the deployment's tests are kept together:

- in every worker, the plugin appends :data:`SUFFIX` to the node id of each test that uses the
  deployment, after every other collection hook (as xdist itself appends ``@group`` under
  ``--dist loadgroup``); the controller takes it off again before any report is shown or cached,
  so the user sees, and ``--lf``/``--sw`` record, the plain node ids;
- on the controller, :class:`OneDeployment` is the scheduler (``pytest_xdist_make_scheduler``).
  Until the collection is in, it is xdist's own scheduler for the ``--dist`` mode; if no test
  uses the deployment it stays that, so a project that merely has the package installed is
  scheduled as it always was. Otherwise, for ``load``, ``loadscope``, ``loadfile``,
  ``loadgroup`` and ``worksteal``, it becomes the scope scheduling of that mode with one change:
  the tests that use the deployment, together with the rest of each scope that holds one (its
  file under ``loadfile``, its module or class under ``loadscope``, its group under
  ``loadgroup``), form one work unit, which xdist gives to one worker, in collection order (the
  teardown's tests last). ``load`` and ``worksteal`` run as ``loadgroup`` does: every other test
  is a unit of its own; ``worksteal`` loses its stealing. Under ``each`` every worker runs
  every test, so every worker would rent: the run stops before any test runs, with a usage
  error that says why and what to pass instead.

What this does not cover: a worker that crashes while it holds the deployment. xdist then runs
the rest of its unit on another worker, which rents again (the crashed worker's instances end
with their own time-to-live, ``--ppsmoke-node-ttl``, or ``pp-smoke-run --reap``).

Imported by the plugin only on an xdist controller.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from xdist.scheduler import (
    EachScheduling,
    LoadFileScheduling,
    LoadGroupScheduling,
    LoadScheduling,
    LoadScopeScheduling,
    WorkStealingScheduling,
)

from .nodeids import XDIST_SUFFIX as SUFFIX
from .nodeids import plain_nodeid as plain

UNIT = "ppsmoke: the deployment's tests"  # the work unit they form (no file, module or group has this name)

# xdist's own scheduler for each --dist mode (as its DSession makes them)
XDIST = {
    "each": EachScheduling,
    "load": LoadScheduling,
    "loadscope": LoadScopeScheduling,
    "loadfile": LoadFileScheduling,
    "loadgroup": LoadGroupScheduling,
    "worksteal": WorkStealingScheduling,
}


def uses_deployment(nodeid: str) -> bool:
    return nodeid.endswith(SUFFIX)


class _Together:
    """Over one of xdist's scope schedulers: the tests that use the deployment, and every scope
    that holds one, form the one unit :data:`UNIT`."""

    joined: set[str] = set()  # the mode's scopes that hold a test that uses the deployment
    registered_collections: dict[Any, list[str]]
    collection: list[str] | None

    def _split_scope(self, nodeid: str) -> str:
        scope: str = super()._split_scope(plain(nodeid))  # type: ignore[misc]
        return UNIT if uses_deployment(nodeid) or scope in self.joined else scope

    def schedule(self) -> None:
        if self.collection is None and self.registered_collections:
            first = next(iter(self.registered_collections.values()))
            split = super()._split_scope  # type: ignore[misc]
            self.joined = {split(plain(n)) for n in first if uses_deployment(n)}
        super().schedule()  # type: ignore[misc]


class _Alone(LoadScopeScheduling):  # type: ignore[misc]
    def _split_scope(self, nodeid: str) -> str:
        return nodeid


class LoadTogether(_Together, _Alone):
    """``load`` and ``worksteal``: each other test alone."""


class GroupTogether(_Together, LoadGroupScheduling):  # type: ignore[misc]
    """``loadgroup``: each other test with its group, or alone."""


class ScopeTogether(_Together, LoadScopeScheduling):  # type: ignore[misc]
    """``loadscope``: each other test with its module or class."""


class FileTogether(_Together, LoadFileScheduling):  # type: ignore[misc]
    """``loadfile``: each other test with its file."""


TOGETHER: dict[str, Any] = {
    "load": LoadTogether,
    "worksteal": LoadTogether,
    "loadgroup": GroupTogether,
    "loadscope": ScopeTogether,
    "loadfile": FileTogether,
}

EACH_REFUSED = (
    "pytest-ppsmoke: --dist each runs every test in every worker, so every worker would rent its own "
    "deployment of the tests that use it ({count} of them). Pass --dist load (or loadscope, loadfile, "
    "loadgroup, worksteal: the plugin runs those tests in one worker), or -n 0, or deselect them"
)


class OneDeployment:
    """xdist's scheduler for the ``--dist`` mode, until the collection shows tests that use the
    deployment: then the mode's scope scheduling with those tests in one unit (the module's
    docstring). Implements xdist's ``Scheduling`` protocol by delegation."""

    def __init__(self, config: pytest.Config, log: Any) -> None:
        self.config, self.log = config, log
        self.mode: str = config.getvalue("dist")
        self.inner: Any = XDIST[self.mode](config, log)
        self.decided = False
        self._nodes: list[Any] = []  # what the inner scheduler was told before the decision
        self._collections: dict[Any, list[str]] = {}

    def __repr__(self) -> str:
        return f"OneDeployment({self.mode}, {type(self.inner).__name__})"

    @property
    def nodes(self) -> list[Any]:
        return list(self.inner.nodes)

    @property
    def collection_is_completed(self) -> bool:
        return bool(self.inner.collection_is_completed)

    @property
    def tests_finished(self) -> bool:
        return bool(self.inner.tests_finished)

    @property
    def has_pending(self) -> bool:
        return bool(self.inner.has_pending)

    def add_node(self, node: Any) -> None:
        if not self.decided:
            self._nodes.append(node)
        self.inner.add_node(node)

    def add_node_collection(self, node: Any, collection: Sequence[str]) -> None:
        if not self.decided:
            self._collections[node] = list(collection)
        self.inner.add_node_collection(node, collection)

    def remove_node(self, node: Any) -> str | None:
        if not self.decided and node in self._nodes:
            self._nodes.remove(node)
            self._collections.pop(node, None)
        crashed: str | None = self.inner.remove_node(node)
        return crashed  # the registered id (with SUFFIX): mark_test_pending takes it back

    def mark_test_complete(self, node: Any, item_index: int, duration: float = 0) -> None:
        self.inner.mark_test_complete(node, item_index, duration)

    def mark_test_pending(self, item: str) -> None:
        self.inner.mark_test_pending(item)

    def remove_pending_tests_from_node(self, node: Any, indices: Sequence[int]) -> None:
        self.inner.remove_pending_tests_from_node(node, indices)

    def schedule(self) -> None:
        if not self.decided:
            self.decided = True
            self._decide()
        self.inner.schedule()

    def _decide(self) -> None:
        collections = list(self._collections.values())
        if not collections or any(c != collections[0] for c in collections):
            return  # nothing collected, or the workers disagree: xdist's own scheduler says so
        count = sum(map(uses_deployment, collections[0]))
        if not count:
            return
        if self.mode == "each":
            pytest.exit(EACH_REFUSED.format(count=count), returncode=pytest.ExitCode.USAGE_ERROR)
        inner = TOGETHER[self.mode](self.config, self.log)
        for node in self._nodes:
            inner.add_node(node)
        for node, collection in self._collections.items():
            inner.add_node_collection(node, collection)
        self.inner = inner
