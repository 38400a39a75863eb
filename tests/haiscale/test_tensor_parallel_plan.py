"""The pure parts of haiscale's tensor parallel: the fused-row order and the block plan."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from fireflyer.errors import UserError
from fireflyer.haiscale.tensor_parallel import (FusedColwiseParallel, block_plan, check_divides, fused_rows_order,
                                                restore_fused, tensor_parallel)


@given(st.integers(1, 4), st.sampled_from([1, 2, 4]), st.integers(1, 3))
def test_fused_order_gives_each_shard_its_share_of_every_chunk(chunks, tp, per_shard):
    n = tp * per_shard
    rows = torch.arange(chunks * n)
    shards = rows[fused_rows_order(chunks * n, chunks, tp)].chunk(tp)
    for r, shard in enumerate(shards):
        want = torch.cat([rows[c * n + r * per_shard:c * n + (r + 1) * per_shard] for c in range(chunks)])
        assert torch.equal(shard, want)
    weight = torch.randn(chunks * n, 3)
    assert torch.equal(restore_fused(weight[fused_rows_order(chunks * n, chunks, tp)], chunks, tp), weight)


def test_fused_order_refuses_rows_it_cannot_cut():
    with pytest.raises(UserError, match="fused weight of 10 rows cannot be cut into 3 chunks of 2 shards"):
        fused_rows_order(10, 3, 2)


def test_check_divides_says_what_and_how():
    check_divides("attention heads", 4, 2)
    with pytest.raises(UserError, match=r"tp=4 does not divide the attention heads \(6\).*Choose a tp that divides 6"):
        check_divides("attention heads", 6, 4)


def test_block_plan_styles():
    plain = block_plan("blocks.0", heads=4)
    assert set(plain) == {"blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.0", "blocks.0.mlp.2"}
    assert isinstance(plain["blocks.0.attn.qkv"], FusedColwiseParallel)
    assert isinstance(plain["blocks.0.mlp.0"], ColwiseParallel)
    assert isinstance(plain["blocks.0.mlp.2"], RowwiseParallel)
    sp = block_plan("blocks.0", heads=4, sequence_parallel=True)
    assert isinstance(sp["blocks.0.ln1"], SequenceParallel) and isinstance(sp["blocks.0.ln2"], SequenceParallel)
    assert {"blocks.0.attn", "blocks.0.mlp"} <= set(sp)


def test_a_plan_naming_missing_modules_is_refused():
    with pytest.raises(UserError, match="names modules this model lacks: blocks.9.attn.qkv"):
        tensor_parallel(nn.Sequential(nn.Linear(2, 2)), object(), {"blocks.9.attn.qkv": ColwiseParallel()})
