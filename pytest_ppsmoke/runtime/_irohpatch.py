"""The one place where we patch the iroh Python binding.

uniffi's generated ``_UniffiRustBufferBuilder.write`` copies a bytes argument into the Rust
buffer one byte at a time in Python. Every frame we send crosses that method, so a large
activation spends most of its send in pure Python before QUIC sees it (docs/benchmarks.md has
the throughput with and without the patch). We replace the method with a single
``ctypes.memmove``.

The patch is applied only if the method is exactly the code we reviewed (its source hash below).
If a later iroh release changes it, importing this module raises :class:`IrohPatchError` so that
somebody looks at the new code instead of silently patching something else.
"""

from __future__ import annotations

import ctypes
import hashlib
import inspect
import textwrap
from typing import Any

from iroh import iroh_ffi

# sha256 of the dedented source of _UniffiRustBufferBuilder.write in iroh 1.2.0
_REVIEWED_WRITE_SHA256 = "d6abf3ad6f8c695131e33602c631a5c965df84cc6780e1a1fcc38d2d8c83c06e"


class IrohPatchError(RuntimeError):
    """The iroh binding no longer looks like the code this patch was written for."""


def _fast_write(self: Any, value: bytes | bytearray | memoryview) -> None:
    view = memoryview(value).cast("B")
    n = view.nbytes
    with self._reserve(n):
        dst = ctypes.addressof(self.rbuf.data.contents) + self.rbuf.len
        if isinstance(value, bytes):
            ctypes.memmove(dst, value, n)
        elif not view.readonly:  # bytearray and friends: no intermediate copy
            ctypes.memmove(dst, (ctypes.c_char * n).from_buffer(view), n)
        else:
            ctypes.memmove(dst, bytes(view), n)


_fast_write.__ppsmoke_patch__ = True  # type: ignore[attr-defined]


def _source_sha256(fn: Any) -> str:
    return hashlib.sha256(textwrap.dedent(inspect.getsource(fn)).encode()).hexdigest()


def _self_test() -> None:  # the generated binding is untyped
    builder: Any
    payload = bytes(range(256)) * 17 + b"tail"
    builder = getattr(iroh_ffi, "_UniffiRustBufferBuilder")()  # noqa: B009
    try:
        builder.write(b"ab")
        builder.write(bytearray(payload[:100]))
        builder.write(memoryview(payload)[100:])
        got = builder.rbuf.data[0 : builder.rbuf.len]
    finally:
        builder.discard()
    if got != b"ab" + payload:
        raise IrohPatchError("patched iroh RustBuffer write produced different bytes from its input")


def _iroh_version() -> str:
    import importlib.metadata  # some 15-30 ms a process: only for the error's words

    return importlib.metadata.version("iroh")


def apply() -> None:
    """Replace the byte-at-a-time copy with memmove (idempotent)."""
    builder = getattr(iroh_ffi, "_UniffiRustBufferBuilder", None)
    if builder is None or not hasattr(builder, "write") or not hasattr(builder, "_reserve"):
        raise IrohPatchError(
            f"iroh {_iroh_version()}: _UniffiRustBufferBuilder.write/_reserve not found; "
            "review pytest_ppsmoke/runtime/_irohpatch.py for this release"
        )
    if getattr(builder.write, "__ppsmoke_patch__", False):
        return
    digest = _source_sha256(builder.write)
    if digest != _REVIEWED_WRITE_SHA256:
        raise IrohPatchError(
            f"iroh {_iroh_version()} changed _UniffiRustBufferBuilder.write "
            f"(source sha256 {digest}, reviewed {_REVIEWED_WRITE_SHA256}); "
            "check whether it still copies byte by byte and update pytest_ppsmoke/runtime/_irohpatch.py"
        )
    builder.write = _fast_write
    _self_test()


def is_applied() -> bool:
    return bool(getattr(iroh_ffi._UniffiRustBufferBuilder.write, "__ppsmoke_patch__", False))
