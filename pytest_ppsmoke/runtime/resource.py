"""The async context manager shape shared by nodes, clusters, deployments and the emulator."""

from __future__ import annotations

from typing import Any, TypeVar

R = TypeVar("R", bound="Resource")


class Resource:
    """``async with`` over ``start()`` and ``close()``. A resource whose start fails half way
    (bound, rented, spawned) closes itself before the error goes on, so nothing is left behind."""

    async def start(self) -> Any:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self: R) -> R:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
