"""Tests of checkpoint: the manager, its codec and safety rules, and crashes and ranks for real.

No fixture is shared by several of this part's files yet: put the first here. Suite-wide settings live
in tests/conftest.py; cost is marked per file (pytestmark: multiproc, integration, cuda, root).
"""
