"""The main job: ``fireflyer train`` trains a small GPT with haiscale DDP on emulated nodes.

The parts, in the order a run meets them:

* :mod:`~fireflyer.train.cli` resolves the config, readies the out directory
  (:mod:`~fireflyer.train.outdir`) and launches the job (one torchrun agent per emulated
  node); afterwards it draws the loss curve and prints the summary (:mod:`~fireflyer.train.report`).
* :mod:`~fireflyer.train.config`: :class:`TrainConfig`, a keyword-only dataclass read
  from TOML and flags, which checks itself.
* :mod:`~fireflyer.train.job` is one rank: it joins the hfreduce process group and runs
  the :class:`~fireflyer.train.trainer.Trainer`; as a platform task (no launcher) its rank 0
  resolves the out directory itself.
* :mod:`~fireflyer.train.records` turns the text into record shards once, cached by content
  hash; :mod:`~fireflyer.train.data` (corpus, character tokenizer, batches read through
  the storage part: sampler, record dataset, shard cache),
  :mod:`~fireflyer.train.model` (the GPT), :mod:`~fireflyer.train.optim` (AdamW,
  warm-up and cosine), :mod:`~fireflyer.train.state` (save and ``--resume``),
  :mod:`~fireflyer.train.progress` (rank 0's progress bar).
"""

from fireflyer.train.config import TrainConfig

__all__ = ["TrainConfig"]
