"""Renting GPUs: the vast.ai client, its emulator ``pp-fake-vast``, and the deployment lifecycle."""
