"""The CPU test suite. Its folders mirror the repository: training/, planning/, measurement/ and tools/ test
the package's layers, recipes/ the numbered recipes and run_all.sh, devtools/ the proof and GPU tools, docs/
the documentation; the package's top-level modules (config, faults, paths) and its shape are tested here.
Shared fixtures are in conftest.py, tiny models and data files in tiny.py."""
