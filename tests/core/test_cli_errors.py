"""Bad input through the ``fireflyer`` door: one line on stderr, a non-zero exit, never a traceback.

The CLI catches fireflyer's error root (``FireflyerError``) alone, so an error that escapes
it as a plain ``ValueError`` or ``OSError`` fails here as the bug it is. The commands run
in this process (the same ``main`` the console script calls), so the cases stay cheap.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fireflyer import cli


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad-input")
    (d / "bad.toml").write_text("steps = 'x'\n[[[")
    (d / "garbage.log").write_bytes(bytes(range(256)) * 8)
    (d / "a-file").write_text("not a folder")
    (d / "not-json.json").write_text("{nope")
    return d


CASES = [
    # train and demo
    ["train", "{d}/bad.toml"], ["train", "--nodes", "0"], ["train", "--nodes", "x"], ["train", "--heads", "5"],
    ["train", "--lr", "nan"], ["train", "--out", "/proc/fireflyer-nope"], ["train", "--out", "{d}/a-file"],
    ["train", "--device", "tpu"], ["train", "--context", "999999999"], ["train", "{d}/no-such.toml"],
    ["train", "--resume", "--out", "{d}/never-ran"], ["demo", "--steps", "0"],
    # validator and failures
    ["validate", "--checks", "nosuch"], ["validate", "--profile", "nosuch"], ["validate", "--profile", "{d}/bad.toml"],
    ["validate", "--xid-log", "{d}/no-such.log"], ["validate", "--since", "yesterdayish"], ["validate", "--ranks", "0"],
    ["validate", "--storage-mb", "-1"], ["validate", "--budget-scale", "0"],
    ["failures", "{d}/no-such.log"], ["failures", "--year", "abc", "{d}/garbage.log"],
    ["failures", "--window", "-1", "{d}/garbage.log"], ["failures", "--plot", "/proc/fireflyer-nope/x.png", "{d}/garbage.log"],
    ["failures", "--boot-time", "notatime", "{d}/garbage.log"],
    ["failures", "--checkpoint-json", "{d}/no-such.json", "{d}/garbage.log"],
    ["failures", "--checkpoint-json", "{d}/not-json.json", "{d}/garbage.log"],
    # hfreduce tools
    ["hfreduce", "trace", "{d}/garbage.log"], ["hfreduce", "trace", "{d}/no-such-dir"],
    # the platform (no platform in the home given)
    ["platform", "nosuch"], ["platform", "quota", "a", "b", "notapriority", "--home", "{d}/nohome"],
    ["submit", "-n", "0", "--home", "{d}/nohome", "--", "true"],
    ["submit", "-n", "1", "-p", "mega", "--home", "{d}/nohome", "--", "true"],
    ["submit", "-n", "1", "--home", "{d}/nohome"], ["submit", "-n", "1", "--home", "{d}/nohome", "--", "true"],
    ["queue", "--limit", "-5", "--home", "{d}/nohome"], ["queue", "--home", "{d}/nohome"],
    ["describe", "x", "--home", "{d}/nohome"], ["describe", "99", "--home", "{d}/nohome"],
    ["logs", "1", "--rank", "-1", "--home", "{d}/nohome"], ["nodes", "--home", "{d}/nohome"],
    ["drain", "nonode", "--home", "{d}/nohome"], ["nodes", "--home", "{d}/a-file"],
    ["queue", "--server", "http://127.0.0.1:9"], ["queue", "--server", "not a url"],
    ["platform", "serve", "--port", "-1", "--home", "{d}/nohome"], ["platform", "user", "list", "--home", "{d}/nohome"],
    # fabric and storage models
    ["plan", "--gpus", "0"], ["plan", "--gpus", "many"], ["plan", "--gpus", "100", "--node", "nosuch"],
    ["plan", "--gpus", "100", "--catalog", "{d}/no-such.toml"], ["plan", "--gpus", "100", "--catalog", "{d}/bad.toml"],
    ["plan", "--gpus", "100", "--plot", "/proc/fireflyer-nope"], ["plan", "--gpus", "100", "--plot", "{d}/a-file"],
    ["simulate", "nosuch"], ["simulate", "allreduce", "--gpus", "-1"], ["simulate", "allreduce", "--size", "huge"],
    ["simulate", "placement", "--tasks", "x"], ["simulate", "allreduce", "--plot", "/proc/fireflyer-nope/a.png"],
    ["cache", "nosuch"], ["cache", "simulate", "--shards", "-1"], ["cache", "simulate", "--local-prob", "2"],
    ["cache", "simulate", "--plot", "/proc/fireflyer-nope/c.png"],
    # benchmarks: flags are checked before anything runs
    ["bench", "fabric", "--out", "/proc/fireflyer-nope"], ["bench", "storage", "--records", "-1"],
    ["bench", "checkpoint", "--mib", "-1"], ["bench", "platform", "--tasks", "0"], ["bench", "alltoall", "--layouts", "0x0"],
]


@pytest.mark.parametrize("args", CASES, ids=[" ".join(a) for a in CASES])
def test_bad_input_gets_one_line_and_a_non_zero_exit(args, files, capsys, monkeypatch):
    monkeypatch.setenv("FIREFLYER_PLATFORM_HOME", str(files / "nohome"))
    monkeypatch.delenv("FIREFLYER_SERVER", raising=False)
    code = cli.main([a.format(d=files) for a in args])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code != 0, err
    assert len(lines) == 1 and lines[0].startswith(f"fireflyer {args[0]}"), err
    assert "Traceback" not in err
    assert not os.path.exists("/proc/fireflyer-nope")
