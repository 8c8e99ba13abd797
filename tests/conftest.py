from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest_asyncio

from pytest_ppsmoke.runtime.node import Node, NodeConfig
from pytest_ppsmoke.runtime.swim import SwimConfig

NodeFactory = Callable[..., "AsyncIterator[Node]"]


@pytest_asyncio.fixture
async def nodes() -> AsyncIterator[Callable[..., object]]:
    """Start in-process nodes on loopback; every one is closed after the test, in reverse."""
    started: list[Node] = []

    async def start(config: NodeConfig, join: bool = True) -> Node:
        node = Node(config)
        started.append(node)
        await node.start(join=join)
        return node

    yield start
    errors = []
    for node in reversed(started):
        try:
            await node.close()
        except Exception as e:
            errors.append(e)
    assert not errors, errors


def cluster_configs(n: int, swim: SwimConfig | None = None) -> list[NodeConfig]:
    """n configs that allow each other; the first is the seed (set ``seed`` on the rest)."""
    configs = [NodeConfig.generate(swim=swim or SwimConfig.loopback()) for _ in range(n)]
    allowed = frozenset(c.id for c in configs)
    for c in configs:
        c.allowed = allowed
    return configs
