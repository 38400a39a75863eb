"""The skeleton every benchmark fills in: the order of its pieces, what it writes and prints, and its ranks'
spec and results (no ranks are started here)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from fireflyer.bench import skeleton
from fireflyer.errors import UserError


@dataclass(frozen=True)
class _Config:
    out_dir: str
    n: int


def _configure(argv: list[str]) -> _Config:
    if len(argv) != 2:
        raise UserError("need OUT N")
    return _Config(out_dir=argv[0], n=int(argv[1]))


def test_the_pieces_run_in_order_and_the_files_are_named(tmp_path, capsys):
    calls = []

    def plot(path: str, cfg: _Config, result: int) -> None:
        calls.append("plot")
        open(path, "wb").close()

    code = skeleton.run_bench(
        [str(tmp_path), "3"], part="demo", configure=_configure,
        measure=lambda cfg: calls.append("measure") or cfg.n * 2,
        report=lambda cfg, result: calls.append("report"),
        fields=lambda cfg, result: calls.append("fields") or {"result": result},
        plot=plot, verdict=lambda cfg, result: calls.append("verdict") or 1)
    assert code == 1 and calls == ["measure", "report", "fields", "plot", "verdict"]
    doc = json.loads((tmp_path / "demo.json").read_text())
    assert list(doc)[:3] == ["timestamp", "command", "machine"] and doc["result"] == 6
    assert doc["command"] == ["fireflyer", "bench", "demo", str(tmp_path), "3"]
    assert (tmp_path / "demo.png").exists()
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {tmp_path / 'demo.json'} and {tmp_path / 'demo.png'}"


def test_own_head_own_paths_and_json_only(tmp_path, capsys):
    out = tmp_path / "x.json"
    assert skeleton.run_bench([str(tmp_path), "1"], part="demo", configure=_configure, measure=lambda cfg: cfg.n,
                              fields=lambda cfg, result: {"bench": "demo", "n": result}, head=lambda argv: {},
                              paths=lambda cfg: (str(out), str(tmp_path / "unused.png")), indent=2) == 0
    assert json.loads(out.read_text()) == {"bench": "demo", "n": 1} and out.read_text().startswith('{\n  "bench"')
    assert not (tmp_path / "unused.png").exists()
    assert capsys.readouterr().out == f"wrote {out}\n"


def test_a_bad_flag_stops_before_anything_runs(tmp_path):
    with pytest.raises(UserError, match="need OUT N"):
        skeleton.run_bench([], part="demo", configure=_configure, measure=pytest.fail, fields=pytest.fail)


def test_a_worker_writes_what_its_run_returns_where_the_parent_reads_it(tmp_path, capsys):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out_dir": str(tmp_path), "x": 5}))
    assert skeleton.worker_main([str(spec)], "python -m demo", lambda s: {"rank": 3, "x": s["x"]}) == 0
    assert json.loads(open(skeleton.rank_result_path(str(tmp_path), 3)).read()) == {"rank": 3, "x": 5}
    assert skeleton.worker_main([str(spec)], "python -m demo", lambda s: None) == 0  # serves, writes nothing
    assert skeleton.worker_main([], "python -m demo", pytest.fail) == 2
    assert capsys.readouterr().err == "usage: python -m demo SPEC.json\n"
