"""Tests of hfreduce: the engine's pieces in one process, its collectives and exchanges on real ranks
(LocalCluster, torchrun), and between network namespaces.

No fixture is shared by several of this part's files yet: put the first here. Suite-wide settings live
in tests/conftest.py; cost is marked per file (pytestmark: multiproc, integration, cuda, root).
"""
