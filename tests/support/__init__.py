"""Shared code of the tests: no tests here, only what test modules import.

Test modules import from this package, never from one another (tests/test_layout.py checks it).
"""
