import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def pytest_addoption(parser):
    group = parser.getgroup("zeropp")
    group.addoption("--conformance-seeds", type=int, default=3,
                    help="cases test_conformance.py draws per layout (default 3)")
    group.addoption("--conformance-first-seed", type=int, default=0,
                    help="the first seed test_conformance.py draws from (default 0)")
