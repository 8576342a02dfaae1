"""What a step trains on: the global batch and the learning rate of each step, pure functions of
the seed and the step number (so that any layout, and a resumed run, computes the same thing)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .flags import _fail


def _mix(seed: int, step: int, salt: int = 0) -> int:
    """A 63-bit seed from (seed, step): splitmix64's finalizer, so nearby steps get unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + salt * 0x94D049BB133111EB) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) & (2**63 - 1)


class TokenBatches:
    """The global batch of each step, a pure function of ``(seed, step)`` and the data.

    ``batch(step)`` is a ``(global_batch, seq + 1)`` int64 CPU tensor. ``synthetic``: each row is an
    arithmetic sequence of token ids modulo the vocabulary (random start and stride, so a model can
    learn it and the loss falls). A file: each row is ``seq + 1`` consecutive tokens from an offset.
    """

    def __init__(self, spec: str, vocab: int, seed: int, global_batch: int, seq: int, tokens=None):
        self.spec, self.vocab, self.seed, self.rows, self.seq = spec, vocab, seed, global_batch, seq
        self.tokens = tokens
        if spec != "synthetic":
            if self.tokens is None:
                self.tokens = self._open(spec, vocab)
            if len(self.tokens) < seq + 1:
                _fail(f"--data {spec} holds {len(self.tokens)} tokens, fewer than one sequence of --seq {seq} + 1; "
                      "use a shorter --seq or more data")

    @staticmethod
    def _open(spec: str, vocab: int):
        import numpy as np

        path = Path(spec)
        if not path.is_file():
            _fail(f"--data {spec!r}: no such file (give 'synthetic', a .npy file or a raw .bin file of token ids, or "
                  "text: a .jsonl or .txt file or a directory of them, with --tokenizer)")
        if path.suffix == ".npy":
            try:
                arr = np.load(path, mmap_mode="r")
            except (OSError, ValueError) as e:
                _fail(f"--data {spec}: not a readable .npy file ({e}); pass a 1-D integer array "
                      "written by numpy.save")
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                _fail(f"--data {spec}: expected a 1-D integer array of token ids, got shape {arr.shape} "
                      f"dtype {arr.dtype}")
            return arr
        if path.suffix == ".bin":
            dtype = np.uint16 if vocab < 65536 else np.uint32
            if path.stat().st_size % np.dtype(dtype).itemsize:
                _fail(f"--data {spec}: size {path.stat().st_size} bytes is not a whole number of {np.dtype(dtype).name} "
                      f"token ids (.bin files must hold uint16 ids when the vocabulary is < 65536, else uint32)")
            return np.memmap(path, dtype=dtype, mode="r")
        _fail(f"--data {spec}: unknown file type {path.suffix!r}; use a .npy or a raw .bin file of token ids, or "
              "text (.jsonl, .txt) with --tokenizer")

    def batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_mix(self.seed, step, 1))
        n = self.seq + 1
        if self.tokens is None:
            start = torch.randint(0, self.vocab, (self.rows, 1), generator=g)
            stride = torch.randint(1, 8, (self.rows, 1), generator=g)
            return (start + stride * torch.arange(n)) % self.vocab
        import numpy as np

        offsets = torch.randint(0, len(self.tokens) - n + 1, (self.rows,), generator=g).tolist()
        out = torch.from_numpy(np.stack([np.asarray(self.tokens[o:o + n], dtype=np.int64) for o in offsets]))
        top = int(out.max())
        if top >= self.vocab or int(out.min()) < 0:
            _fail(f"--data {self.spec}: token id {top} at step {step} is outside the model's vocabulary "
                  f"(0..{self.vocab - 1}); token ids must be below the vocabulary size, so check "
                  "that --data was tokenized for this model")
        return out


class EvalBatches:
    """Held-out batches: the first ``count`` global batches of consecutive, non-overlapping windows of ``seq + 1``
    tokens (the same every evaluation, so eval losses compare across steps and layouts)."""

    def __init__(self, spec: str, tokens, vocab: int, global_batch: int, seq: int, count: int):
        self.spec, self.tokens, self.vocab, self.rows, self.seq = spec, tokens, vocab, global_batch, seq
        windows = len(tokens) // (seq + 1)
        if windows < global_batch:
            _fail(f"--eval-data {spec} holds {len(tokens)} tokens, fewer than one global batch of --global-batch "
                  f"{global_batch} x (--seq {seq} + 1); give more held-out data or a shorter --seq")
        self.count = min(count, windows // global_batch)

    def batch(self, index: int) -> torch.Tensor:
        import numpy as np

        n = self.seq + 1
        start = index * self.rows * n
        out = torch.from_numpy(np.asarray(self.tokens[start:start + self.rows * n], dtype=np.int64)).view(self.rows, n)
        if int(out.max()) >= self.vocab or int(out.min()) < 0:
            _fail(f"--eval-data {self.spec}: token id {int(out.max())} is outside the model's vocabulary "
                  f"(0..{self.vocab - 1}); token ids must be below the vocabulary size, so check that --eval-data "
                  "was tokenized for this model")
        return out


def _tokens_of(spec: str, ns, vocab: int, flag: str, mode: str):
    """The token ids of ``spec`` (None for synthetic data): a token file, or text through its token cache.
    ``mode``: "prepare" tokenizes text that has no cache yet, "check" only checks (nothing written), "open"
    expects the cache (prepared by the launching process or rank 0)."""
    from .text import is_text, token_cache

    if spec == "synthetic":
        return None
    if not is_text(spec):
        return TokenBatches._open(spec, vocab)
    cache = token_cache(spec, ns.tokenizer, vocab, flag=flag, write=mode == "prepare")
    if cache is None:
        if mode == "open":
            where = f"{flag} {spec}"
            _fail(f"{where}: its token cache is missing (rank 0 tokenizes the text before the others read it); "
                  "check that every rank sees the same file system")
        return ()
    return cache.open()


def open_data(ns, vocab: int, mode: str = "open"):
    """``(train batches, eval batches or None)`` of ``--data`` / ``--eval-data`` (see :func:`_tokens_of`)."""
    tokens = _tokens_of(ns.data, ns, vocab, "--data", mode)
    if tokens is not None and len(tokens) == 0:  # text checked, not tokenized (a dry run)
        return None, None
    train = TokenBatches(ns.data, vocab, ns.seed, ns.global_batch, ns.seq, tokens=tokens)
    evaluation = None
    if ns.eval_data:
        if ns.eval_data == "synthetic":
            _fail("--eval-data synthetic: held-out data must be a file (token ids or text)")
        held = _tokens_of(ns.eval_data, ns, vocab, "--eval-data", mode)
        if len(held):
            evaluation = EvalBatches(ns.eval_data, held, vocab, ns.global_batch, ns.seq, ns.eval_batches)
    return train, evaluation


# ------------------------------------------------------------------------------------------------ learning rate
def lr_at(ns, step: int) -> float:
    """Learning rate of step ``step`` (1-based): linear warmup, then cosine decay to 10% or constant."""
    if ns.warmup and step <= ns.warmup:
        return ns.lr * step / ns.warmup
    if ns.lr_schedule == "constant":
        return ns.lr
    span = max(1, ns.steps - ns.warmup - 1)  # the first step after warmup runs at the peak, the last at 10%
    progress = min(1.0, (step - ns.warmup - 1) / span)
    return ns.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))
