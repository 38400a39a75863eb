"""Tests of train: the main job's config and parts, and ``fireflyer train`` end to end.

Suite-wide settings (the training records' cache in the session's tmp among them) live in
tests/conftest.py; cost is marked per file (pytestmark: multiproc, integration, cuda, root).
"""

from __future__ import annotations

import pytest


@pytest.fixture
def text_file(tmp_path):
    """A small UTF-8 text: 6,000 characters of the shipped plays, enough for short epochs."""
    from fireflyer.train.records import load_corpus

    path = tmp_path / "plays.txt"
    path.write_text(load_corpus()[:6000], encoding="utf-8")
    return path
