"""The Python-backend (BLS) translator model: see model.py."""
