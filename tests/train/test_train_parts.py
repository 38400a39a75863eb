"""The main job's parts in one process: corpus and batches, model, schedule, saved state, report."""

from __future__ import annotations

import faulthandler
import io
import math
import os
import signal
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fireflyer import lifetime
from fireflyer.checkpoint import CheckpointManager, committed_steps
from fireflyer.checkpoint.manager import PERSIST_DELAY_ENV
from fireflyer.errors import UserError
from fireflyer.train import job
from fireflyer.train import report, state
from fireflyer.train.config import TrainConfig
from fireflyer.train.data import SAMPLE_PROMPT, CharTokenizer, RecordBatches, load_corpus
from fireflyer.train.records import prepare, read_corpus, split, tokenize
from fireflyer.train.model import GPT, ModelShape
from fireflyer.train.optim import build_optimizer, lr_at
from fireflyer.train.progress import PlainLines, StepStats, Throughput


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def test_corpus_is_plain_shakespeare(corpus):
    assert 300_000 < len(corpus) < 600_000
    assert corpus.startswith("BERNARDO:\nWho's there?\n")
    for marker in ("**", "#", "_", "[", "]"):
        assert marker not in corpus
    tok = CharTokenizer.from_text(corpus)
    assert tok.vocab_size < 70 and all(c in tok.chars for c in SAMPLE_PROMPT)


def test_tokenizer_round_trip(corpus):
    tok = CharTokenizer.from_text(corpus)
    text = corpus[:5000]
    ids = tok.encode(text)
    assert ids.dtype == torch.long and tok.decode(ids) == text
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("caf\u00e9")


def test_split_holds_out_spread_blocks():
    tokens = np.arange(100_000)
    train, val = split(tokens, 0.1, block=1000)
    assert len(train) + len(val) == len(tokens)
    assert len(val) == 10_000
    assert val[0] == 9000 and val[-1] == 99_999  # every tenth block, from the whole text
    assert not set(train.tolist()) & set(val.tolist())


def test_the_records_tokenizer_agrees_with_the_model_side_one(corpus):
    vocab, ids = tokenize(corpus)
    tok = CharTokenizer.from_text(corpus)
    assert vocab == tok.chars and ids.dtype == np.uint8
    assert np.array_equal(ids[:3000], tok.encode(corpus[:3000]).numpy())


def test_batches_depend_on_seed_rank_and_step_only(tmp_path, text_file):
    prepared = prepare(read_corpus(text_file), tmp_path, context=16, val_fraction=0.1)
    cpu = torch.device("cpu")

    def batches(seed=1, rank=0):
        return RecordBatches(prepared.dir / "train", name="train", batch=4, rank=rank, world_size=2, seed=seed,
                             device=cpu)

    b = batches()
    x, y = b.batch(5)
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    text = read_corpus(text_file).text
    for row_x, row_y in zip(x, y, strict=True):  # each window is a stretch of the text, and its next characters
        window = prepared.vocab[row_x[0]] + CharTokenizer(prepared.vocab).decode(row_y)
        assert window in text
    assert torch.equal(batches().batch(5)[0], x)
    assert not torch.equal(batches(rank=1).batch(5)[0], x)
    assert not torch.equal(b.batch(6)[0], x)
    assert not torch.equal(batches(seed=2).batch(5)[0], x)
    b.close()


def test_model_shapes_tied_embedding_and_causality():
    torch.manual_seed(0)
    m = GPT(ModelShape(vocab_size=11, context=8, layers=2, d_model=16, heads=4))
    assert m.head.weight is m.tok.weight
    expected = 11 * 16 + 8 * 16 + 2 * (12 * 16 * 16 + 13 * 16) + 2 * 16
    assert m.num_parameters() == expected
    x = torch.randint(0, 11, (2, 8))
    logits = m(x)
    assert logits.shape == (2, 8, 11)
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % 11  # changing the last token changes no earlier prediction
    assert torch.equal(m(y)[:, :-1], logits[:, :-1])
    with pytest.raises(ValueError, match="longer than the model's context"):
        m(torch.zeros(1, 9, dtype=torch.long))


def test_generation_is_seeded():
    torch.manual_seed(0)
    m = GPT(ModelShape(vocab_size=5, context=4, layers=1, d_model=8, heads=2))
    prompt = torch.tensor([1, 2])
    a = m.generate(prompt, 10, generator=torch.Generator().manual_seed(3))
    b = m.generate(prompt, 10, generator=torch.Generator().manual_seed(3))
    assert a.shape == (12,) and torch.equal(a, b) and torch.equal(a[:2], prompt)
    assert torch.equal(m.generate(prompt, 3, temperature=0), m.generate(prompt, 3, temperature=0))


def test_warmup_then_cosine_to_min_lr():
    cfg = TrainConfig.from_fields(steps=100, warmup_steps=10, lr=1e-2, min_lr=1e-3)
    assert lr_at(0, cfg) == pytest.approx(1e-3)
    assert lr_at(9, cfg) == pytest.approx(1e-2)
    assert lr_at(55, cfg) == pytest.approx(1e-3 + 0.5 * 9e-3 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(100, cfg) == pytest.approx(1e-3)
    m = torch.nn.Linear(2, 2)
    opt, sched = build_optimizer(m, cfg)
    assert [g["weight_decay"] for g in opt.param_groups] == [cfg.optimizer.weight_decay, 0.0]
    seen = []
    for _ in range(12):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(s, cfg) for s in range(12)])
    # The scheduler's position survives a save and load (without pickling the config).
    _, fresh = build_optimizer(m, cfg)
    fresh.load_state_dict(sched.state_dict())
    assert fresh.last_epoch == 12 and "cfg" not in sched.state_dict()


def test_states_go_through_the_checkpoint_manager_and_are_pruned(tmp_path):
    assert state.latest_step(tmp_path) is None
    mgr = state.manager(tmp_path, rank=0, world_size=1)
    for step in (10, 20, 30):
        mgr.save(step, state.payload(step, model={"w": torch.full((2,), float(step))}), blocking=True)
    assert state.latest_step(tmp_path) == 30
    assert sorted(p.name for p in state.ckpt_dir(tmp_path).iterdir()) == ["step_0000000020", "step_0000000030"]
    loaded = state.load_state(tmp_path)
    assert loaded["step"] == 30 and torch.equal(loaded["model"]["w"], torch.full((2,), 30.0))
    assert state.load_state(tmp_path, 20)["step"] == 20
    # a damaged newest state: resume falls back to the one before, with a warning
    shard = state.ckpt_dir(tmp_path) / "step_0000000030" / "rank00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.warns(UserWarning, match="step 30 is damaged"):
        assert state.load_state(tmp_path)["step"] == 20
    with pytest.raises(UserError, match="cannot resume"):
        state.load_state(tmp_path, 30)


def _run_json(cfg: TrainConfig) -> dict:
    """A finished run's ``run.json``, as rank 0 writes it, for ``cfg``'s world."""
    return {
        "config": cfg.to_dict(), "finished": True, "step": 3, "resumed_from": None,
        "world": {"nodes": cfg.parallelism.nodes, "ranks_per_node": cfg.parallelism.ranks_per_node, "world_size": cfg.world_size,
                  "device": "cpu", "threads_per_rank": 1},
        "model": {"parameters": 400_000, "vocab_size": 63},
        "data": {"corpus_chars": 1000, "train_tokens": 900, "val_tokens": 100, "tokens_per_step": 4096,
                 "source": "shakespeare.txt (shipped)", "hash": "ab" * 32, "window": 65,
                 "records": {"train": 13, "val": 1}, "shards": {"train": 1, "val": 1},
                 "cache_hit_rate": 0.9876, "stall_s": 0.0125},
        "history": {"loss": [4.2, 3.5, 3.0], "lr": [1e-3, 1e-3, 1e-3], "val": [[0, 4.2], [3, 3.1]]},
        "timing": {"train_s": 1.0, "eval_s": 0.1, "save_s": 0.0, "steps_this_run": 3, "tokens_per_s": 12288.0,
                   "sample_s": 0.1},
        "allreduce": {"bytes_per_rank": 5e6, "seconds": 0.1, "exposed_wait_s": 0.05, "gbps": 0.05, "buckets": 1},
        "sample": {"prompt": "ROMEO:\n", "text": "ROMEO:\nO, she doth teach the torches to burn bright!"},
    }


def test_resume_skips_a_step_folder_that_holds_an_older_step(tmp_path):
    """``cp -r step_0000000020/* step_0000000030/``: --resume (load_state) warns and takes step 20 itself,
    never step 20's state as if it were step 30; asking for step 30 is refused naming both."""
    import shutil

    mgr = state.manager(tmp_path, rank=0, world_size=1)
    for step in (20, 30):
        mgr.save(step, state.payload(step, model={"w": torch.full((2,), float(step))}), blocking=True)
    older, newer = state.ckpt_dir(tmp_path) / "step_0000000020", state.ckpt_dir(tmp_path) / "step_0000000030"
    for f in older.iterdir():
        shutil.copy2(f, newer / f.name)
    assert state.latest_step(tmp_path) == 30
    with pytest.warns(UserWarning, match="step 30 is damaged.*records step 20, not 30"):
        assert state.load_state(tmp_path)["step"] == 20
    with pytest.raises(UserError, match="cannot resume.*step 30: .*records step 20, not 30"):
        state.load_state(tmp_path, 30)


def test_report_plot_and_summary(tmp_path):
    run = _run_json(TrainConfig.from_fields(steps=3, warmup_steps=1))
    png = report.plot_losses(run, tmp_path / "loss.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    text = report.summary(run, wall_s=5.0, out=tmp_path, png=png)
    assert len(text.splitlines()) <= 24, "one screen"
    for needle in ("finished", "0.40 M parameters", "2 nodes x 2 ranks", "12.3 k tokens/s", "0.05 GB/s",
                   "train 4.200 (step 1)", "val 4.200 (step 0) -> 3.100 (step 3)", "loss.png", "| ROMEO:",
                   "13 + 1 windows of 65 tokens in 2 shards (abababababab)", "hit rate 98.8%",
                   "reader stall 0.013 s", "characters of shakespeare.txt (shipped)"):
        assert needle in text


def test_summary_counts_in_the_singular_and_names_the_experts_right(tmp_path):
    """One node, one layer, one thread: no "1 nodes"; an MoE run's experts line says what expert_hidden is."""
    run = _run_json(TrainConfig.from_fields(steps=3, warmup_steps=1, nodes=1, ranks_per_node=2, layers=1))
    run["layout"] = {"pp": 1, "dp": 1, "ep": 2, "tp": 1}
    run["model"].update(kind="moe", experts=8, expert_hidden=128, shared_experts=2, top_k=2, experts_per_rank=4,
                        parameters_per_rank=[300_000, 300_000])
    run["experts"] = {"imbalance": [1.5, 1.25, 1.0], "all_to_all_bytes": [1e6, 1e6, 1e6]}
    png = report.plot_losses(run, tmp_path / "loss.png")
    text = report.summary(run, wall_s=5.0, out=tmp_path, png=png)
    for needle in ("1 layer, d_model", "1 node x 2 ranks = 2 ranks on cpu, 1 thread per rank",
                   "8 routed experts (hidden 128 each) + 2 shared, top-2, 4 per rank",
                   "1.25 (mean of the last 3 steps)", "in 2 shards"):
        assert needle in text, text
    for wrong in ("1 nodes", "1 layers", "1 threads", "routed of"):
        assert wrong not in text, text


def test_plural_counts_a_noun():
    from fireflyer.cliutil import plural

    assert [plural(n, "node") for n in (0, 1, 2)] == ["0 nodes", "1 node", "2 nodes"]
    assert plural(1, "micro-batch", "micro-batches") == "1 micro-batch"
    assert plural(4, "micro-batch", "micro-batches") == "4 micro-batches"


def test_throughput_and_plain_progress_lines():
    rate = Throughput(window=2)
    assert rate.add(1.0, 100) == 100.0
    assert rate.add(0.5, 100) == pytest.approx(200 / 1.5)
    assert rate.add(0.5, 100) == pytest.approx(200.0)  # the first step has left the window
    buf = io.StringIO()
    lines = PlainLines(first=1, total=10, every=5, stream=buf)
    for step in range(1, 11):
        lines.update(StepStats(step, 3.0, 1e-3, 12_345.0, 0.5))
    out = buf.getvalue().splitlines()
    assert [ln.split()[1] for ln in out] == ["1/10", "5/10", "10/10"]
    assert out[-1] == "step 10/10  loss 3.0000  lr 1.00e-03  12.3k tok/s  allreduce 0.50 GB/s"


def test_a_stop_while_the_rank_waits_for_its_save_lets_the_save_finish(tmp_path, monkeypatch):
    """The usual order of a stopped multi-node run: a peer stops first, this rank's collective fails, and this
    rank's own SIGTERM arrives while it waits for its save in flight. The save is still finished and committed,
    and the stop (not the peer's failure) is what the rank reports."""
    monkeypatch.setenv(PERSIST_DELAY_ENV, "1.5")
    monkeypatch.setenv(lifetime.GRACE, "60")

    class Run:  # the trainer's part that train() touches, around a real checkpoint manager
        where = SimpleNamespace(rank=0)

        def __init__(self) -> None:
            self.ckpt = CheckpointManager(tmp_path, rank=0, world_size=1)

        def run(self) -> None:
            self.ckpt.save(1, {"x": torch.arange(4.0)})
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
            raise RuntimeError("a peer's failure")

        def close(self) -> None:
            pass

    handlers = {s: signal.getsignal(s) for s in lifetime.STOP_SIGNALS}
    try:
        lifetime.graceful(60)
        with pytest.raises(lifetime.Stopped, match="SIGTERM"):
            job.train(Run)
    finally:
        faulthandler.cancel_dump_traceback_later()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert committed_steps(str(tmp_path)) == [1]
    assert torch.equal(CheckpointManager(tmp_path, rank=0, world_size=1).load()["x"], torch.arange(4.0))
