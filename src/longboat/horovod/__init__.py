"""Horovod's API on longboat's core: ``import longboat.horovod.torch as hvd``.

Only the PyTorch flavour exists (``longboat.horovod.torch``); see docs/horovod.md.
"""
