"""Renting GPUs: the vast.ai client, its emulator ``pp-fake-vast``, the rental of one run's instances."""
