"""``python -m pytest_ppsmoke.cloud.emulator``: ``pp-fake-vast``."""

from .server import main

main()
