"""Processes the tests look for after a run: nothing of a node may be left behind."""

from __future__ import annotations

from pathlib import Path

TEST_TAG = "PPSMOKE_TEST_TAG"  # not PP_*: the emulator passes everything else through to its nodes


def node_processes(tag: str) -> list[int]:
    """Live processes (zombies excluded: already dead) whose environment carries ``TEST_TAG=tag``:
    the nodes and workers a test started, and nothing that another run on this machine started."""
    want = f"{TEST_TAG}={tag}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and want in env:
            found.append(int(d.name))
    return found
