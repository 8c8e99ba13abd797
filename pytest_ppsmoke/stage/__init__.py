"""One pipeline stage: the split tinygrad model, the worker bridge, ``pp-gpu-node`` and the synthetic models."""
