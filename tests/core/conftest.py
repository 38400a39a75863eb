"""Tests of core: the top modules (cli, launch) and the testing wing itself (LocalCluster, ShapedLink).

No fixture is shared by several of this part's files yet: put the first here. Suite-wide settings live
in tests/conftest.py; cost is marked per file (pytestmark: multiproc, integration, cuda, root).
"""
