"""Tests of storage: backends, record shards, the cache and its simulator, the sampler, and S3 for real.

No fixture is shared by several of this part's files yet: put the first here. Suite-wide settings live
in tests/conftest.py; cost is marked per file (pytestmark: multiproc, integration, cuda, root).
"""
