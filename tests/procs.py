"""Processes the tests look for after a run: nothing of a node may be left behind."""

from __future__ import annotations

from pathlib import Path

NODE_COMMANDS = (b"pytest_ppsmoke.gpu_node", b"pp_tinygrad_worker", b"stalled_worker")


def node_processes() -> list[int]:
    """Live node and worker processes on this machine (zombies excluded: they are already dead)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(n in cmd for n in NODE_COMMANDS):
            found.append(int(d.name))
    return found
