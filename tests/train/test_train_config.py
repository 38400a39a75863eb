"""TrainConfig checks itself; its sections map onto TOML tables and its fields onto flags; a flat file of the format
before the sections still loads, with a one-line note; bad input is one line through the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fireflyer import cli
from fireflyer.errors import UserError
from fireflyer.train.config import (FIELD_NAMES, FIELDS, SECTIONS, TrainConfig, builtin_config, check_resumable,
                                    read_toml, upgrade_saved)


def test_defaults_and_shipped_configs_are_valid():
    demo = TrainConfig.from_toml(builtin_config("demo"))
    assert demo == TrainConfig(), "the dataclass defaults are the demo's"
    tiny = TrainConfig.from_toml(builtin_config("tiny"))
    assert tiny.world_size == 2 and tiny.run.steps < demo.run.steps
    assert tiny.tokens_per_step == tiny.data.global_batch * tiny.model.context == 2 * tiny.batch_per_replica * tiny.model.context


def test_keyword_only():
    with pytest.raises(TypeError):
        TrainConfig(2)  # type: ignore[misc]


@pytest.mark.parametrize("field,value,needle", [
    ("nodes", 0, "nodes must be at least 1"),
    ("ranks_per_node", -1, "ranks_per_node must be at least 1"),
    ("steps", 0, "steps must be at least 1"),
    ("heads", 3, "heads (3) must divide d_model (128)"),
    ("lr", 0.0, "lr must be positive"),
    ("min_lr", 1.0, "min_lr (1.0) must not exceed lr"),
    ("warmup_steps", 10_000, "warmup_steps (10000) must not exceed steps"),
    ("val_fraction", 0.9, "val_fraction must be in (0, 0.5]"),
    ("device", "tpu", "device must be one of auto, cpu, cuda"),
    ("stop_at", 0, "stop_at must be between 1 and steps"),
    ("stop_at", 10_000, "stop_at must be between 1 and steps"),
    ("timeout", -5.0, "timeout must be positive"),
    ("save_every", -1, "save_every must not be negative"),
    ("steps", "10", "steps must be an integer, got '10'"),
    ("steps", True, "steps must be an integer"),
    ("steps", 2.5, "steps must be an integer"),
    ("lr", "fast", "lr must be a number"),
    ("lr", float("nan"), "lr must be a number"),
    ("out", 3, "out must be a string"),
    ("out", "", "out must name a directory"),
])
def test_bad_values_name_the_field(field, value, needle):
    with pytest.raises(UserError) as exc:
        TrainConfig.from_fields(**{field: value})
    assert needle in str(exc.value)
    assert isinstance(exc.value, ValueError)


def test_integers_are_accepted_for_float_fields():
    cfg = TrainConfig.from_fields(lr=1, min_lr=0, timeout=30)
    assert isinstance(cfg.optimizer.lr, float) and cfg.optimizer.lr == 1.0 and isinstance(cfg.run.timeout, float)


def test_toml_file_and_overrides(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nkind = "moe"\nlayers = 1\n\n[run]\nsteps = 40\nout = "somewhere"\n')
    cfg = TrainConfig.from_toml(path, steps=50, data="plays.txt")
    assert (cfg.run.steps, cfg.model.layers, cfg.model.kind, cfg.run.out) == (50, 1, "moe", "somewhere")
    assert cfg.data.path == "plays.txt" and cfg.model.d_model == TrainConfig().model.d_model
    assert capsys.readouterr().err == "", "a file in sections loads without a note"


def test_sections_fields_and_flags_agree():
    cfg = TrainConfig.from_fields(nodes=1, ranks_per_node=4, model="moe", ep=2, data="x.txt", data_cache="c", lr=1e-3,
                                  save_every=5, steps=50)
    assert list(cfg.to_dict()) == list(SECTIONS) == ["model", "parallelism", "data", "optimizer", "checkpoint", "run"]
    assert cfg.to_dict()["model"]["kind"] == "moe" and cfg.to_dict()["data"]["path"] == "x.txt"
    assert cfg.to_dict()["data"]["cache"] == "c" and cfg.to_dict()["checkpoint"] == {"save_every": 5}
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg == TrainConfig.from_dict(cfg.fields())
    assert cfg.replace(steps=60).run.steps == 60 and cfg.replace(steps=60).model == cfg.model
    assert set(FIELDS) == set(FIELD_NAMES) and len(FIELD_NAMES) == sum(len(k.__dataclass_fields__) for k in SECTIONS.values())
    with pytest.raises(UserError, match="model must be a ModelConfig"):
        TrainConfig(model="moe")  # type: ignore[arg-type]


def test_a_flat_file_of_the_format_before_the_sections_loads_with_a_one_line_note(tmp_path, capsys):
    flat, sectioned = tmp_path / "flat.toml", tmp_path / "sectioned.toml"
    flat.write_text('nodes = 1\nranks_per_node = 2\nmodel = "moe"\nep = 2\nsteps = 40\nlr = 1e-3\nmin_lr = 1e-4\n'
                    'data = "plays.txt"\n')
    sectioned.write_text('[model]\nkind = "moe"\n[parallelism]\nnodes = 1\nranks_per_node = 2\nep = 2\n'
                         '[data]\npath = "plays.txt"\n[optimizer]\nlr = 1e-3\nmin_lr = 1e-4\n[run]\nsteps = 40\n')
    assert TrainConfig.from_toml(flat) == TrainConfig.from_toml(sectioned)
    note = capsys.readouterr().err.strip().splitlines()
    assert len(note) == 1 and note[0].startswith(f"note: {flat} lists nodes, ranks_per_node, model, ... outside any "
                                                 "section") and "deprecated" in note[0] and "[model]" in note[0]


@pytest.mark.parametrize("text,needle", [
    ("[run]\nstpes = 40\n", "unknown key 'stpes' in [run]; valid keys there: steps, seed, device"),
    ("[run]\nlayers = 2\n", "unknown key 'layers' in [run]; valid keys there: steps"),
    ("[modle]\nlayers = 2\n", "unknown table [modle]; the sections are model, parallelism, data, optimizer, "
                                "checkpoint, run"),
    ("stpes = 40\n", "unknown key 'stpes'; valid keys: model, context, layers"),
    ("[run]\nsteps = \n", "not valid TOML"),
    ('[run]\nsteps = "many"\n', "steps must be an integer"),
    ('[model]\nkind = "sparse"\n', "model must be one of dense, moe"),
])
def test_bad_toml(tmp_path, text, needle):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(UserError) as exc:
        TrainConfig.from_toml(path)
    assert needle in str(exc.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        read_toml(tmp_path / "nope.toml")
    with pytest.raises(UserError, match="is a directory"):
        read_toml(tmp_path)


def test_resume_needs_the_same_model_shape_and_world_size():
    saved = TrainConfig().to_dict()
    assert check_resumable(saved, TrainConfig(), state="s") == []
    assert check_resumable(saved, TrainConfig.from_fields(lr=1e-3, min_lr=1e-4, steps=400), state="s") == ["lr", "min_lr", "steps"]
    # Another layout of the same world size reads the same batches: allowed.
    assert check_resumable(saved, TrainConfig.from_fields(nodes=1, ranks_per_node=4), state="s") == ["nodes", "ranks_per_node"]
    with pytest.raises(UserError, match=r"cannot resume s: .*layers 2 -> 3; d_model 128 -> 96"):
        check_resumable(saved, TrainConfig.from_fields(layers=3, d_model=96), state="s")
    with pytest.raises(UserError, match="world size 4 -> 2"):
        check_resumable(saved, TrainConfig.from_fields(nodes=1), state="s")


@pytest.mark.parametrize("layout,per_replica", [
    (dict(nodes=1, ranks_per_node=1), 8), (dict(nodes=1, ranks_per_node=2), 4), (dict(nodes=2, ranks_per_node=4), 1),
    (dict(nodes=2, ranks_per_node=2, pp=2, layers=2), 4), (dict(nodes=2, ranks_per_node=2, model="moe", ep=2), 2),
])
def test_the_global_batch_is_the_same_on_every_layout_and_the_layout_divides_it(layout, per_replica):
    cfg = TrainConfig.from_fields(global_batch=64, micro_batch_size=8, **layout)
    assert cfg.global_micro_batches == 8 and cfg.micro_batches == per_replica
    assert cfg.batch_per_replica == per_replica * 8 and cfg.tokens_per_step == 64 * cfg.model.context
    assert cfg.micro_batches * cfg.replicas == cfg.global_micro_batches
    each = "pipeline" if cfg.parallelism.pp > 1 else "rank"
    assert cfg.describe_batch().startswith(f"global batch 64 sequences = 8 micro-batches of 8; {per_replica} micro-batch")
    assert f"x {cfg.replicas} {each}" in cfg.describe_batch()


@pytest.mark.parametrize("fields,needle", [
    (dict(micro_batch_size=5), "micro_batch_size (5) must divide global_batch (64)"),
    (dict(nodes=1, ranks_per_node=3), "the global batch's 64 sequences = 4 micro-batches of 16 cannot be shared "
     "evenly among 3 data-parallel replicas (1 node x 3 ranks); choose a global_batch that is a multiple of 3 x 16 "
     "(48, 96, 144, ...)"),
    (dict(pp=2, global_batch=32), "a pipeline of 2 stages needs at least 2 micro-batches per step"),
    (dict(global_batch=1 << 20, micro_batch_size=1, nodes=1, ranks_per_node=1), "at most 65,536: raise micro_batch_size"),
    (dict(global_batch=0), "global_batch must be at least 1"),
    (dict(order="canonical", global_batch=96, micro_batch_size=8), "needs a power-of-two count of micro-batches per "
     "replica (1, 2, 4, ...), but each gets 3"),
])
def test_a_batch_the_layout_cannot_divide_is_refused_with_the_reason(fields, needle):
    with pytest.raises(UserError) as err:
        TrainConfig.from_fields(**fields)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_per_rank_batch_of_earlier_versions_is_refused_in_a_config_and_read_in_a_saved_run():
    with pytest.raises(UserError, match=r"x.toml: batch_per_rank, micro_batches are replaced by global_batch and "
                                        r"micro_batch_size.*global_batch = 32, micro_batch_size = 4"):
        TrainConfig.from_dict({"batch_per_rank": 8, "micro_batches": 2}, source="x.toml")
    old = {k: v for k, v in TrainConfig().fields().items() if k not in ("global_batch", "micro_batch_size")}
    assert upgrade_saved({**old, "batch_per_rank": 16, "micro_batches": 1}) == TrainConfig().fields()
    piped = upgrade_saved({**old, "pp": 2, "layers": 2, "batch_per_rank": 16, "microbatches": 4, "micro_batches": 1})
    assert piped["global_batch"] == 32 and piped["micro_batch_size"] == 4
    assert check_resumable({**old, "batch_per_rank": 16}, TrainConfig(), state="s") == []


def test_a_state_saved_flat_before_the_sections_resumes_and_one_saved_in_sections_too():
    assert upgrade_saved(TrainConfig().to_dict()) == TrainConfig().fields()
    assert check_resumable(TrainConfig().fields(), TrainConfig(), state="s") == []
    assert check_resumable(TrainConfig().to_dict(), TrainConfig.from_fields(steps=400), state="s") == ["steps"]
    with pytest.raises(UserError, match="layers 2 -> 3"):
        check_resumable(TrainConfig().fields(), TrainConfig.from_fields(layers=3), state="s")


def test_every_field_has_a_flag_with_help():
    from fireflyer.train.cli import build_parser

    text = build_parser().format_help()
    for name in FIELD_NAMES:
        assert f"--{name.replace('_', '-')}" in text
    assert "Emulated nodes" in text and "--resume" in text
    for section in SECTIONS:
        assert f"[{section}] fields" in text
    words = " ".join(text.split())  # help wraps its lines
    assert "(in a config: [model] kind)" in words and "(in a config: [data] path)" in words


@pytest.mark.parametrize("args,needle", [
    (["nosuch.toml"], "config file 'nosuch.toml' not found"),
    (["--steps", "0"], "steps must be at least 1"),
    (["--steps", "many"], "argument --steps: invalid int value"),
    (["--heads", "5"], "heads (5) must divide d_model"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["a.toml", "b.toml"], "unrecognized arguments: b.toml"),
])
def test_bad_input_through_the_cli_is_one_line(args, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", *args]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fireflyer train: error: ") and needle in lines[0], captured.err
    assert not (tmp_path / "runs").exists(), "nothing is written before the config is known to be good"


def test_resume_without_a_saved_state(capsys, tmp_path):
    assert cli.main(["train", "--out", str(tmp_path / "empty"), "--resume"]) == 2
    assert "no saved state in" in capsys.readouterr().err


def test_bad_input_in_a_real_process_has_no_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nlayers = 0\n")
    done = subprocess.run([sys.executable, "-m", "fireflyer.cli", "demo", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "fireflyer demo: error: layers must be at least 1, got 0"
    bad.write_text("layers = 0\n")  # the flat format: the note, then the error
    done = subprocess.run([sys.executable, "-m", "fireflyer.cli", "demo", str(bad)],
                          capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 2 and lines[0].startswith("note: ") and \
        lines[1] == "fireflyer demo: error: layers must be at least 1, got 0"
