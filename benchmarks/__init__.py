"""The project's benchmarks, probes and profiles (see ``benchmarks/README.md``).

Run from the repository root: ``python -m benchmarks`` lists every script, and
``python -m benchmarks NAME [ARGS]`` (or ``python -m benchmarks.GROUP.NAME [ARGS]``) runs one.
"""
