"""Helpers shared by airserve's tests: tiny models built in code, a decode driver, a server
process, reference kernels. Importable as `airserve_testing` (pytest's `pythonpath = ["test"]`)."""
