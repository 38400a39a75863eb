"""``CanonicalLinear`` and its tensor-parallel pieces: nn.Linear to rounding in one process, the bits of one
process on TP=2 and TP=4 (forward, input gradient, weight gradients, after SGD steps) for an MLP and for an
attention piece with a fused ``qkv`` (``chunks=3``), and clear refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fireflyer.errors import UserError, UserTypeError
from fireflyer.haiscale.canonical_linear import CanonicalLinear, canonicalize, check_blocks
from fireflyer.hfreduce.plans.canonical import canonical_sum
from fireflyer.testing.cases import canonical_linear as cases
from fireflyer.testing.cluster import ClusterPool


@pytest.fixture(scope="module")
def clusters():
    pool = ClusterPool({"2": [2], "4": [4]}, env={"FIREFLYER_TEST_COMM": "0"})
    yield pool.get
    pool.close()


# -- one process -------------------------------------------------------------------------------


@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_it_is_nn_linear_to_rounding_forward_and_backward(blocks):
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    layer = CanonicalLinear.from_linear(linear, blocks)
    x = torch.randn(3, 5, 32) * 4
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = layer(xa), linear(xb)
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad, linear.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.bias.grad, linear.bias.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("blocks", [1, 2, 4])
def test_a_fused_qkv_is_nn_linear_to_rounding_and_loads_its_state_dict(blocks):
    torch.manual_seed(4)
    linear = nn.Linear(16, 3 * 16)
    layer = CanonicalLinear(16, 3 * 16, blocks=blocks, chunks=3)
    layer.load_state_dict(linear.state_dict())
    assert all(torch.equal(v, linear.state_dict()[k]) for k, v in layer.state_dict().items())
    x = torch.randn(3, 5, 16) * 4
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = layer(xa), linear(xb)  # both [q; k; v] along the last dim
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    for got, want in ((ya, yb), (xa.grad, xb.grad), (layer.weight.grad, linear.weight.grad),
                      (layer.bias.grad, linear.bias.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(CanonicalLinear.from_linear(linear, blocks, chunks=3).weight, linear.weight)


def test_a_fused_block_is_one_slice_of_every_chunk():
    """Block b's rows are the b-th quarter of q, of k and of v: dx is the tree over those blocks' products."""
    torch.manual_seed(5)
    layer = CanonicalLinear(16, 3 * 8, bias=False, blocks=4, chunks=3, dtype=torch.bfloat16)
    x = torch.randn(6, 16, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    rows = [torch.cat([torch.arange(c * 8 + b * 2, c * 8 + b * 2 + 2) for c in range(3)]) for b in range(4)]
    w = layer.weight.detach()
    assert torch.equal(x.grad, canonical_sum([dy[:, r].contiguous() @ w[r] for r in rows]))
    dw = torch.empty_like(w)
    for r in rows:
        for k in range(4):
            dw[r, k * 4:(k + 1) * 4] = dy[:, r].contiguous().t() @ x.detach()[:, k * 4:(k + 1) * 4].contiguous()
    assert torch.equal(layer.weight.grad, dw)
    assert "chunks=3" in repr(layer)


def test_gradcheck_in_float64():
    layer = CanonicalLinear(8, 4, blocks=2, dtype=torch.float64)
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: torch.func.functional_call(layer, {"weight": w, "bias": b}, (x,)),
                                    (x, layer.weight, layer.bias))


def test_state_dicts_move_between_it_and_nn_linear():
    torch.manual_seed(1)
    layer = CanonicalLinear(16, 8, blocks=4)
    torch.manual_seed(1)
    assert torch.equal(nn.Linear(16, 8).weight, layer.weight)  # the same initial draws
    linear = nn.Linear(16, 8)
    linear.load_state_dict(layer.state_dict())
    back = CanonicalLinear(16, 8, blocks=2)
    back.load_state_dict(linear.state_dict())
    assert torch.equal(back.weight, layer.weight) and torch.equal(back.bias, layer.bias)
    assert CanonicalLinear(16, 8, bias=False, blocks=2).bias is None


def test_bf16_sums_blocks_in_the_canonical_tree_in_fp32_and_rounds_once():
    torch.manual_seed(2)
    layer = CanonicalLinear(64, 8, bias=False, blocks=4, dtype=torch.bfloat16)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    y = layer(x)
    products = [x[:, k * 16:(k + 1) * 16] @ layer.weight[:, k * 16:(k + 1) * 16].t() for k in range(4)]
    assert y.dtype == torch.bfloat16 and torch.equal(y, canonical_sum(products))
    assert torch.equal(y, ((products[0].float() + products[1].float())
                           + (products[2].float() + products[3].float())).bfloat16())


def test_canonicalize_converts_the_named_linears_with_their_weights():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Sequential(nn.Linear(16, 8)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert canonicalize(model, 2, ["2.0"]) is model
    assert isinstance(model[0], nn.Linear) and isinstance(model[2][0], CanonicalLinear)
    canonicalize(model, 2)
    assert isinstance(model[0], CanonicalLinear) and model[0].blocks == 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert isinstance(canonicalize(nn.Linear(4, 4), 4), CanonicalLinear)
    attn = nn.Sequential(nn.Linear(8, 24), nn.Linear(8, 8))
    canonicalize(attn, 2, chunks={"0": 3})
    assert (attn[0].chunks, attn[1].chunks) == (3, 1)
    assert canonicalize(nn.Linear(8, 24), 4, chunks=3).chunks == 3


def test_one_process_refusals():
    for blocks in (0, 3, 6, True, 2.0):
        with pytest.raises(UserError, match=r"^blocks must be a power of two"):
            CanonicalLinear(8, 8, blocks=blocks)
    with pytest.raises(UserError, match=r"^in_features=6 is not divisible by blocks=4"):
        CanonicalLinear(6, 8, blocks=4)
    with pytest.raises(UserError, match=r"^out_features=2 is not divisible by blocks=4"):
        CanonicalLinear(8, 2, blocks=4)
    with pytest.raises(UserError, match=r"^tensor parallel degree tp=4 does not divide blocks=2"):
        check_blocks(2, 8, 8, 4)
    with pytest.raises(UserError, match=r"takes inputs of 8 features in the last dimension, got shape \(2, 4\)"):
        CanonicalLinear(8, 8, blocks=2)(torch.zeros(2, 4))
    with pytest.raises(UserTypeError, match="from_linear takes an nn.Linear, got Conv1d"):
        CanonicalLinear.from_linear(nn.Conv1d(4, 4, 1), 2)  # type: ignore[arg-type]
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU())
    with pytest.raises(UserError, match=r"^0: in_features=6 is not divisible by blocks=4"):
        canonicalize(model, 4)
    with pytest.raises(UserError, match="has no submodules named 5"):
        canonicalize(model, 2, ["5"])
    with pytest.raises(UserTypeError, match=r"not 1 \(GELU\)"):
        canonicalize(model, 2, ["1"])
    with pytest.raises(UserError, match="not the module itself"):
        canonicalize(model, 2, [""])
    with pytest.raises(UserError, match=r"^out_features=8 is not divisible by chunks\*blocks=3\*2; each of the 3 "):
        CanonicalLinear(8, 8, blocks=2, chunks=3)
    for chunks in (0, True, 1.0):
        with pytest.raises(UserError, match=r"^chunks must be a positive int"):
            CanonicalLinear(8, 12, blocks=2, chunks=chunks)
    with pytest.raises(UserError, match="chunks names 5, which are not among the linears converted"):
        canonicalize(nn.Sequential(nn.Linear(8, 24)), 2, chunks={"5": 3})
    with pytest.raises(UserError, match="pass its chunks as an int"):
        canonicalize(nn.Linear(8, 24), 2, chunks={"": 3})


# -- tensor parallel ---------------------------------------------------------------------------


def _equal(a: dict, b: dict) -> list[str]:
    """The names whose tensors differ in any bit (the same names on both sides)."""
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def _same_bits(got: dict) -> None:
    """Every step's output and gradients, and the weights gathered at the end, are one process's, bit for bit."""
    for step, (ref, tp_step) in enumerate(zip(got["reference"], got["tp"], strict=True)):
        assert _equal(ref, tp_step) == [], step
    assert _equal(got["reference_weights"], got["tp_weights"]) == []  # gathered back in the model's order


@pytest.mark.multiproc
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_gives_the_bits_of_one_process(clusters, tp, dtype):
    results = clusters(str(tp)).run(cases.mlp, 4, 3, dtype, timeout=120)
    for got in results:
        assert got["local_fc"] == (cases.HIDDEN // tp, cases.D_MODEL)
        assert got["local_proj"] == (cases.D_MODEL, cases.HIDDEN // tp)
        _same_bits(got)
    reference = results[0]["reference"]
    assert all(_equal(r["reference"][-1], reference[-1]) == [] for r in results)


@pytest.mark.multiproc
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_attention_with_a_fused_qkv_gives_the_bits_of_one_process(clusters, tp, dtype):
    """x -> column-parallel qkv (chunks=3) -> causal attention over this rank's heads -> row-parallel proj."""
    results = clusters(str(tp)).run(cases.attention, 4, 2, dtype, timeout=120)
    for got in results:
        assert got["local_order"]  # this rank's [q_r; k_r; v_r]
        assert got["local_fc"] == (3 * cases.D_MODEL // tp, cases.D_MODEL)
        _same_bits(got)  # qkv gathered back in [q; k; v] order


@pytest.mark.multiproc
@pytest.mark.parametrize("tp", [2, 4])
def test_the_plain_split_does_not_give_these_bits(clusters, tp):
    """The control: nn.Linear's arithmetic split the usual way agrees with one process only to rounding."""
    for got in clusters(str(tp)).run(cases.plain_split, timeout=120):
        assert not torch.equal(got["split"], got["whole"])
        torch.testing.assert_close(got["split"], got["whole"], rtol=1e-5, atol=1e-5)
        fast = got["fast"]  # order="fast": plain Megatron, the one process's result to rounding
        torch.testing.assert_close(fast["out"], got["whole"], rtol=1e-5, atol=1e-5)
        for name in ("dx", "fc", "proj"):
            torch.testing.assert_close(fast[name], fast[f"whole_{name}"], rtol=1e-5, atol=1e-5)


@pytest.mark.multiproc
def test_tp_refusals(clusters):
    for out in clusters("2").run(cases.refusals, timeout=120):
        assert out["blocks 3"].startswith("UserError: blocks must be a power of two")
        assert out["tp over blocks"].startswith("UserError: tensor parallel degree tp=2 does not divide blocks=1")
        assert out["in features"].startswith("UserError: in_features=10 is not divisible by blocks=4")
        assert out["out features"].startswith("UserError: out_features=6 is not divisible by blocks=4")
        assert out["gloo group"].startswith("UserError: ColumnParallelCanonicalLinear sums over its TP group in the "
                                            "canonical order")
        assert "this gloo group does not" in out["gloo group"]
        assert "this hfreduce group does not" in out["fast group"]
        assert out["no group"] == ("UserTypeError: ColumnParallelCanonicalLinear needs the TP process group, "
                                   "got NoneType")
        assert out["from a conv"].startswith("UserTypeError: from_full takes an nn.Linear or a CanonicalLinear")
        assert out["wrong full shape"] == "UserError: the full weight must have shape (8, 8), got (8, 4)"
        assert out["missing bias"].startswith("UserError: a full state of ColumnParallelCanonicalLinear holds")
        assert out["grads before backward"].startswith("UserError: weight, bias of ColumnParallelCanonicalLinear")
        assert out["wrong width"].startswith("UserError: RowParallelCanonicalLinear takes inputs of 4 features")
        assert out["chunks over blocks"].startswith("UserError: out_features=8 is not divisible by chunks*blocks=3*2")
        assert out["row chunks"].startswith("UserError: RowParallelCanonicalLinear does not split its output "
                                            "features, so it takes no chunks")
