"""Tests of validator: its checks, grading, the Xid catalogue and failure analysis, and ``fireflyer validate`` end to end.

No fixture is shared by several of this part's files yet: put the first here. Suite-wide settings live
in tests/conftest.py; cost is marked per file (pytestmark: multiproc, integration, cuda, root).
"""
