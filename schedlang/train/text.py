"""Text for the trainer: ``.jsonl`` files (a ``text`` field per line), ``.txt`` files (one document
each) or a directory of them, tokenized once into a memory-mapped token cache beside the data.

The cache is ``<data>.tokens-<key>.bin`` (token ids, ``uint16`` when the vocabulary is below 65536,
else ``uint32``) with its description in ``<data>.tokens-<key>.json``, where the key is a content
hash of the text files, the tokenizer's files and the cache format: unchanged text and tokenizer
reuse it, any change makes a new one. Documents are packed one after the other, each followed by
the tokenizer's EOS token. A file that cannot be read (empty, invalid JSON, a line without
``text``) fails with the file and line, and nothing is written: the cache appears (by rename) only
once it is whole.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from .flags import _fail

logger = logging.getLogger("schedlang.train")

TEXT_SUFFIXES = (".jsonl", ".txt")
CACHE_FORMAT = 1
_BATCH_DOCUMENTS = 256


def is_text(spec: str) -> bool:
    path = Path(spec)
    return path.is_dir() or path.suffix in TEXT_SUFFIXES


def text_files(spec: str, flag: str) -> List[Path]:
    path = Path(spec)
    where = f"{flag} {spec}"
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            _fail(f"{where}: the directory holds no .jsonl or .txt file; give a directory of text files (.jsonl with "
                  "a 'text' field per line, .txt one document each)")
        return files
    if not path.is_file():
        _fail(f"{where}: no such file or directory (give a .jsonl file, a .txt file or a directory of them)")
    return [path]


def load_tokenizer(directory: Optional[str], flag: str, vocab: int):
    """``AutoTokenizer.from_pretrained(directory)``, offline, checked against the model's vocabulary."""
    if directory is None:
        where = flag
        _fail(f"{where}: the data is text: give the tokenizer to read it with, --tokenizer DIR (a directory "
              "AutoTokenizer.from_pretrained loads: tokenizer.json, tokenizer_config.json ...)")
    if not Path(directory).is_dir():
        _fail(f"--tokenizer {directory!r}: no such directory (expected a tokenizer saved with save_pretrained)")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as e:  # transformers raises many kinds here (OSError, ValueError, KeyError ...)
        reason = " ".join(str(e).split())[:300]
        _fail(f"--tokenizer {directory}: AutoTokenizer cannot load it ({type(e).__name__}: {reason}); give a "
              "directory written by a tokenizer's save_pretrained")
    size = len(tokenizer)
    if size > vocab:
        _fail(f"--tokenizer {directory}: its vocabulary has {size} tokens, more than the model's {vocab} "
              f"(vocab_size): ids up to {size - 1} would fall outside the embedding; use the model's own tokenizer "
              f"or a config with vocab_size >= {size}")
    if tokenizer.eos_token_id is None:
        _fail(f"--tokenizer {directory}: it has no EOS token, which separates the packed documents; set its "
              "eos_token (tokenizer.add_special_tokens({'eos_token': ...})) and save it again")
    return tokenizer


def _tokenizer_files(directory: str) -> List[Path]:
    return sorted(p for p in Path(directory).iterdir() if p.is_file())


def content_key(files: List[Path], tokenizer_dir: str, eos: int) -> str:
    """A hash of what the cache holds: the text files (names and contents), the tokenizer's files, the EOS id."""
    digest = hashlib.sha256(f"schedlang-token-cache/{CACHE_FORMAT}/eos={eos}".encode())
    for group in (files, _tokenizer_files(tokenizer_dir)):
        for f in group:
            digest.update(f"\0{f.name}\0{f.stat().st_size}\0".encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()[:16]


def _documents(path: Path, flag: str = "--data") -> Iterator[Tuple[int, str]]:
    """``(line, text)`` of each document of a file; refuses an empty file, invalid JSON, a line without text."""
    where = f"{flag} {path}"
    if path.suffix == ".txt":
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            _fail(f"{where}: empty file (a .txt file is one document: give it text, or remove it)")
        yield 1, text
        return
    found = False
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.strip())
            except ValueError as e:
                at = f"{where}:{number}"
                _fail(f"{at}: invalid JSON ({getattr(e, 'msg', e)} at column "
                      f"{getattr(e, 'colno', '?')}); each line of a .jsonl file must be an object with a 'text' "
                      "field")
            if not isinstance(record, dict) or "text" not in record:
                keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                at = f"{where}:{number}"
                _fail(f"{at}: no 'text' field (found {keys or 'an empty object'}); each line "
                      "must be an object with the document in 'text'")
            if not isinstance(record["text"], str):
                at = f"{where}:{number}"
                _fail(f"{at}: 'text' is a {type(record['text']).__name__}, not a string; the document must be a "
                      "JSON string")
            found = True
            yield number, record["text"]
    if not found:
        _fail(f"{where}: empty file (no JSON line with a 'text' field); give it one JSON object per line, e.g. "
              "{\"text\": \"...\"}, or remove it")


@dataclass
class TokenCache:
    path: Path
    dtype: str
    tokens: int
    documents: int

    def open(self):
        import numpy as np

        return np.memmap(self.path, dtype=np.dtype(self.dtype), mode="r", shape=(self.tokens,))


def cache_paths(spec: str, key: str) -> Tuple[Path, Path]:
    path = Path(spec).resolve()
    stem = path.parent / f"{path.name}.tokens-{key}"
    return stem.with_name(stem.name + ".bin"), stem.with_name(stem.name + ".json")


def _read_cache(bin_path: Path, meta_path: Path, key: str) -> Optional[TokenCache]:
    if not (bin_path.is_file() and meta_path.is_file()):
        return None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    import numpy as np

    if meta.get("key") != key or bin_path.stat().st_size != meta.get("tokens", -1) * np.dtype(meta["dtype"]).itemsize:
        return None
    return TokenCache(bin_path, meta["dtype"], meta["tokens"], meta.get("documents", 0))


def token_cache(spec: str, tokenizer_dir: Optional[str], vocab: int, flag: str = "--data",
                write: bool = True) -> Optional[TokenCache]:
    """The token cache of the text ``spec``: reused when its key matches, else tokenized now (``write``), else
    None (the files and the tokenizer checked only)."""
    import numpy as np

    files = text_files(spec, flag)
    tokenizer = load_tokenizer(tokenizer_dir, flag, vocab)
    eos = tokenizer.eos_token_id
    key = content_key(files, tokenizer_dir, eos)
    bin_path, meta_path = cache_paths(spec, key)
    cached = _read_cache(bin_path, meta_path, key)
    if cached is not None:
        logger.info("%s %s: reusing the token cache %s (%d tokens)", flag, spec, bin_path, cached.tokens)
        return cached
    if not write:
        return None
    dtype = np.dtype(np.uint16 if vocab < 65536 else np.uint32)
    partial = bin_path.with_name(f"{bin_path.name}.partial-{os.getpid()}")
    total_bytes = sum(f.stat().st_size for f in files)
    from ..progress import Progress

    tokens = documents = 0
    try:
        with open(partial, "wb") as out, Progress(f"tokenizing {spec}", total=total_bytes, unit="byte") as bar:
            for f in files:
                batch: List[str] = []
                for _, text in _documents(f, flag):
                    batch.append(text)
                    if len(batch) == _BATCH_DOCUMENTS:
                        tokens += _write_batch(tokenizer, batch, eos, dtype, out)
                        documents += len(batch)
                        batch = []
                if batch:
                    tokens += _write_batch(tokenizer, batch, eos, dtype, out)
                    documents += len(batch)
                bar.update(f.stat().st_size, note=f.name)
        meta = {"key": key, "dtype": dtype.name, "tokens": tokens, "documents": documents, "eos": eos,
                "tokenizer": str(Path(tokenizer_dir).resolve()), "files": [str(f) for f in files],
                "format": CACHE_FORMAT}
        meta_partial = meta_path.with_name(f"{meta_path.name}.partial-{os.getpid()}")
        meta_partial.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(partial, bin_path)
        os.replace(meta_partial, meta_path)  # written last: its presence marks the cache whole
    finally:
        partial.unlink(missing_ok=True)
    logger.info("%s %s: %d documents, %d tokens, cached in %s", flag, spec, documents, tokens, bin_path)
    return TokenCache(bin_path, dtype.name, tokens, documents)


def _write_batch(tokenizer, texts: List[str], eos: int, dtype, out) -> int:
    import numpy as np

    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    flat = np.fromiter((t for doc in ids for t in (*doc, eos)), dtype=np.int64)
    if flat.size and int(flat.max()) >= np.iinfo(dtype).max + 1:  # pragma: no cover - checked by the vocabulary
        _fail(f"--tokenizer: it produced token id {int(flat.max())}, beyond {dtype.name}; use a tokenizer whose ids "
              "fit the model's vocabulary")
    out.write(flat.astype(dtype).tobytes())
    return int(flat.size)
