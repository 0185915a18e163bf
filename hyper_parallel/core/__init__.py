"""Core building blocks of hyper_parallel: layouts, distributed tensors, checkpoint."""

__all__ = []
