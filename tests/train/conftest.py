"""Tests of train: the main job's config and parts, and ``fireflyer train`` end to end.

No fixture is shared by several of this part's files yet: put the first here. Suite-wide settings live
in tests/conftest.py; cost is marked per file (pytestmark: multiproc, integration, cuda, root).
"""
