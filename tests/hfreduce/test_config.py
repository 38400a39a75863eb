"""HFReduceConfig: validation that names the field, and FIREFLYER_HFREDUCE_* environment overrides."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest

from fireflyer.hfreduce import HFReduceConfig
from fireflyer.hfreduce.config import DEFAULT_TIMEOUT, default_chunk_bytes

ENV = ("CHUNK_BYTES", "DEPTH", "TIMEOUT", "IFADDR")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(f"FIREFLYER_HFREDUCE_{name}", raising=False)


def test_defaults_are_valid() -> None:
    cfg = HFReduceConfig()
    assert cfg.chunk_bytes is None  # chosen when the group forms, by how many nodes it spans
    for nodes in (1, 2, 64):
        chunk = default_chunk_bytes(nodes)
        assert chunk >= 4096 and chunk % 64 == 0 and HFReduceConfig(chunk_bytes=chunk).chunk_bytes == chunk
    assert default_chunk_bytes(1) < default_chunk_bytes(2)
    assert cfg.depth >= 2
    assert cfg.timeout is None and cfg.settled().timeout > 0  # not set: the one rule decides it
    assert cfg.ifaddr is None


def test_config_is_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        HFReduceConfig(8192)  # type: ignore[misc]
    cfg = HFReduceConfig(chunk_bytes=8192)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.depth = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"chunk_bytes": 4032}, "chunk_bytes"),
        ({"chunk_bytes": 0}, "chunk_bytes"),
        ({"chunk_bytes": 4096 + 32}, "chunk_bytes"),
        ({"chunk_bytes": -4096}, "chunk_bytes"),
        ({"depth": 1}, "depth"),
        ({"depth": 0}, "depth"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": -1.5}, "timeout"),
        ({"timeout": float("nan")}, "timeout"),
    ],
)
def test_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        HFReduceConfig(**kwargs)
    assert str(next(iter(kwargs.values()))) in str(info.value)  # and shows the bad value


@pytest.mark.parametrize("chunk_bytes", [4096, 4160, 1 << 20])
def test_valid_chunk_sizes(chunk_bytes: int) -> None:
    assert HFReduceConfig(chunk_bytes=chunk_bytes, depth=2, timeout=0.001).chunk_bytes == chunk_bytes


def test_from_env_reads_every_variable(monkeypatch) -> None:
    monkeypatch.setenv("FIREFLYER_HFREDUCE_CHUNK_BYTES", "8192")
    monkeypatch.setenv("FIREFLYER_HFREDUCE_DEPTH", "6")
    monkeypatch.setenv("FIREFLYER_HFREDUCE_TIMEOUT", "2.5")
    monkeypatch.setenv("FIREFLYER_HFREDUCE_IFADDR", "10.1.2.3")
    assert HFReduceConfig.from_env() == HFReduceConfig(chunk_bytes=8192, depth=6, timeout=2.5, ifaddr="10.1.2.3")


def test_from_env_without_variables_gives_defaults() -> None:
    assert HFReduceConfig.from_env() == HFReduceConfig()


def test_from_env_empty_variable_means_unset(monkeypatch) -> None:
    monkeypatch.setenv("FIREFLYER_HFREDUCE_DEPTH", "")
    assert HFReduceConfig.from_env().depth == HFReduceConfig().depth


@pytest.mark.parametrize(("name", "raw"), [("CHUNK_BYTES", "1MiB"), ("DEPTH", "4.0"), ("TIMEOUT", "soon")])
def test_from_env_rejects_bad_values_naming_the_variable(monkeypatch, name: str, raw: str) -> None:
    monkeypatch.setenv(f"FIREFLYER_HFREDUCE_{name}", raw)
    with pytest.raises(ValueError, match=f"FIREFLYER_HFREDUCE_{name}") as info:
        HFReduceConfig.from_env()
    assert raw in str(info.value)


def test_from_env_validates_parsed_values(monkeypatch) -> None:
    monkeypatch.setenv("FIREFLYER_HFREDUCE_DEPTH", "1")
    with pytest.raises(ValueError, match="depth"):
        HFReduceConfig.from_env()


def test_from_env_timeout_argument() -> None:
    assert HFReduceConfig.from_env(timeout=timedelta(seconds=5)).timeout == 5.0
    assert HFReduceConfig.from_env(timeout=timedelta(milliseconds=1500)).timeout == 1.5
    assert HFReduceConfig.from_env(timeout=7).timeout == 7.0
    with pytest.raises(ValueError, match="timeout"):
        HFReduceConfig.from_env(timeout=timedelta(0))


def test_from_env_precedence(monkeypatch) -> None:
    # An explicit timeout beats the environment's; explicit overrides beat the environment.
    monkeypatch.setenv("FIREFLYER_HFREDUCE_TIMEOUT", "3")
    monkeypatch.setenv("FIREFLYER_HFREDUCE_DEPTH", "5")
    cfg = HFReduceConfig.from_env(timeout=timedelta(seconds=5), depth=8, ifaddr=None)
    assert cfg.timeout == 5.0
    assert cfg.depth == 8
    assert cfg.ifaddr is None  # None overrides are ignored
    assert HFReduceConfig.from_env().timeout == 3.0  # no explicit one: the environment's


def test_one_timeout_rule_set_beats_given_beats_environment_beats_default(monkeypatch) -> None:
    monkeypatch.delenv("FIREFLYER_HFREDUCE_TIMEOUT", raising=False)
    assert HFReduceConfig().timeout is None, "None means not set"
    assert HFReduceConfig().settled().timeout == DEFAULT_TIMEOUT
    assert HFReduceConfig().settled(default=90).timeout == 90
    monkeypatch.setenv("FIREFLYER_HFREDUCE_TIMEOUT", "7")
    assert HFReduceConfig().settled(default=90).timeout == 7
    assert HFReduceConfig().settled(timedelta(seconds=5), default=90).timeout == 5
    assert HFReduceConfig(timeout=60).settled(timedelta(seconds=5)).timeout == 60, "60 set by hand is set"
    assert HFReduceConfig(timeout=2).settled().timeout == 2


def _world_timeout(**init) -> float:
    """The collective timeout of a one-rank hfreduce world made through ``dist.init_process_group``."""
    import torch.distributed as dist

    import fireflyer.hfreduce  # noqa: F401 - registers the backend

    dist.init_process_group("hfreduce", store=dist.HashStore(), rank=0, world_size=1, **init)
    try:
        return dist.group.WORLD.comm.config.timeout  # with extended_api, WORLD is hfreduce's group itself
    finally:
        dist.destroy_process_group()


def test_the_rule_through_init_process_group(monkeypatch) -> None:
    monkeypatch.delenv("FIREFLYER_HFREDUCE_TIMEOUT", raising=False)
    assert _world_timeout() == 1800, "no timeout anywhere: torch's default, as with gloo"
    monkeypatch.setenv("FIREFLYER_HFREDUCE_TIMEOUT", "7")
    assert _world_timeout() == 7, "the environment beats torch's default"
    assert _world_timeout(timeout=timedelta(seconds=5)) == 5, "torch's explicit timeout beats the environment"
    assert _world_timeout(timeout=timedelta(seconds=5), pg_options=HFReduceConfig(timeout=60)) == 60, \
        "the group's own config beats them all, 60 included"
    assert _world_timeout(pg_options=HFReduceConfig(order="canonical")) == 7


def test_memory_traffic_counts_the_engine_copies():
    from fireflyer.fabric.traffic import engine_traffic as memory_traffic

    S = 1 << 20
    one = memory_traffic(S, 4, 1, 4)
    # stage-in 2*3S (own slice skipped) + reduce 4S read + S written + stage-out 2*4S
    assert one == {"mem_bytes": 19.0 * S, "floor_mem_bytes": 8.0 * S, "link_bytes": 0.0}
    two = memory_traffic(S, 2, 2, 4)
    assert two["link_bytes"] == S  # half of the data up one tree, half down the other
    bf16 = memory_traffic(S, 2, 2, 2)
    assert bf16["link_bytes"] == 1.5 * S  # partial sums go up in fp32
    assert bf16["mem_bytes"] > two["mem_bytes"]


def test_the_path_follows_the_size_thresholds_and_one_shot_counts_its_copies():
    from fireflyer.bench.allreduce_report import engine_path as algorithm
    from fireflyer.fabric.traffic import ONE_SHOT, PIPELINE, TREES
    from fireflyer.fabric.traffic import engine_traffic as memory_traffic

    cfg = HFReduceConfig(oneshot_bytes=64 << 10)
    assert algorithm(64 << 10, 1, cfg) == ONE_SHOT
    assert algorithm((64 << 10) + 4, 1, cfg) == PIPELINE
    assert algorithm(4, 2, cfg) == TREES  # several nodes: always the trees
    assert algorithm(8 << 10, 1, HFReduceConfig(oneshot_bytes=0)) == PIPELINE
    S = 4096
    one = memory_traffic(S, 4, 1, 4, path=ONE_SHOT)
    # copy-in 2*4S, then every rank reads 4 inputs and writes its result: 4*5S
    assert one == {"mem_bytes": 28.0 * S, "floor_mem_bytes": 8.0 * S, "link_bytes": 0.0}
    with pytest.raises(ValueError, match="one node"):
        memory_traffic(S, 2, 2, 4, path=ONE_SHOT)
