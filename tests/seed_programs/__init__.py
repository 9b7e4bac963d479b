"""Seed programs: the user programs ckval's front doors must run as they are written.

Each module is a guide's program with the changes its docstring lists (imports, the one
ckval argument, and what this CPU-only machine without network needs); tests/
test_seed_programs.py and tests/test_dask.py run them.
"""
