"""Triton model sources copied into a model repository by ``python -m export.triton``."""
