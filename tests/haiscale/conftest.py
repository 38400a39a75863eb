"""Tests of haiscale: DDP, FSDP and pipeline parallelism, in one process and on real ranks.

No fixture is shared by several of this part's files yet: put the first here. Suite-wide settings live
in tests/conftest.py; cost is marked per file (pytestmark: multiproc, integration, cuda, root).
"""
