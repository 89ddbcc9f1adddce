"""Training text with no download: byte-level tokens from files every machine has.

Legend: B sequences per rank, S sequence length (tokens), W data-parallel ranks (= EP size), N bytes.

By default the corpus is the Python standard library's own ``*.py`` sources (found through
``sysconfig.get_paths()["stdlib"]``; installed third-party packages and test folders are skipped), so
``python -m megamoe.train`` works offline on any machine. ``--data PATH`` takes any text file or folder.

Tokens are raw bytes (vocabulary 256, no tokenizer to download). The train/validation split is a pure
function of the file list: a file goes to validation when ``crc32(relative path) % 10 == 0``; a single
file (or a split that leaves one side empty) is split by position instead (last 10% to validation).

Batches are a pure function of (seed, step, rank): rank r draws its windows from its own contiguous
shard r/W of the training bytes with a generator seeded by (seed, step, r). Nothing else is stateful,
so a checkpoint only needs the step number to resume the data stream exactly, and an EP=1 run can
rebuild the global batch of an EP=W run by concatenating the W shards' batches in rank order.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Corpus", "default_data_path", "load_corpus", "train_batch", "val_batches"]

VOCAB_SIZE = 256
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", ".git"}
_TEXT_SUFFIXES_DEFAULT = (".py",)
_VAL_MODULUS = 10
# Above this the rest of the corpus is ignored (the stdlib is ~14 MB; a user folder may be huge).
MAX_CORPUS_BYTES = 64 * 2**20


@dataclass
class Corpus:
    """Byte tokens of a corpus.

    train_N / val_N: uint8 [N] CPU tensors (token = byte value). source: where the text came from.
    num_files: files read. Bytes of consecutive files are joined with a newline.
    """

    train_N: torch.Tensor
    val_N: torch.Tensor
    source: str
    num_files: int

    def describe(self) -> str:
        return (f"{self.source}: {self.num_files} files, {self.train_N.numel() / 1e6:.2f} MB train, "
                f"{self.val_N.numel() / 1e6:.2f} MB validation (byte tokens)")


def default_data_path() -> Path:
    """The Python standard library source folder of this interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def _list_files(root: Path, suffixes: tuple[str, ...] | None) -> list[Path]:
    """Regular files under ``root`` in sorted relative-path order (deterministic on every OS)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            if suffixes is not None and not name.endswith(suffixes):
                continue
            found.append(Path(dirpath) / name)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _is_text(blob: bytes) -> bool:
    return b"\x00" not in blob[:4096]


def load_corpus(path: str | os.PathLike | None = None, *, min_bytes: int = 1024) -> Corpus:
    """Read a text file or folder (default: the Python stdlib sources) into byte tokens.

    For a folder every non-hidden text file (no NUL byte in its first 4 KiB) is read; for the default
    stdlib folder only ``*.py`` files. At most ``MAX_CORPUS_BYTES`` are read.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: no readable text, or fewer than ``min_bytes`` bytes in the training or validation part.
    """
    default = path is None
    root = default_data_path() if default else Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(f"--data: {str(root)!r} does not exist (give a text file or a folder of text files)")
    if root.is_file():
        files, rel = [root], [root.name]
    elif root.is_dir():
        files = _list_files(root, _TEXT_SUFFIXES_DEFAULT if default else None)
        rel = [f.relative_to(root).as_posix() for f in files]
    else:
        raise ValueError(f"--data: {str(root)!r} is neither a regular file nor a folder")

    train_parts, val_parts, total, num_read = [], [], 0, 0
    for f, name in zip(files, rel):
        if total >= MAX_CORPUS_BYTES:
            break
        try:
            blob = f.read_bytes()
        except OSError:
            continue  # unreadable file inside a folder: skipped (an unreadable single file ends below)
        if not blob or not _is_text(blob):
            continue
        blob = blob[: MAX_CORPUS_BYTES - total] + b"\n"
        total += len(blob)
        num_read += 1
        (val_parts if zlib.crc32(name.encode()) % _VAL_MODULUS == 0 else train_parts).append(blob)
    if num_read == 0:
        raise ValueError(f"--data: no readable, non-empty text file found at {str(root)!r}")
    if not train_parts or not val_parts:  # one file, or an unlucky split: split by position instead
        blob = b"".join(train_parts + val_parts)
        cut = len(blob) - len(blob) // _VAL_MODULUS
        train, val = blob[:cut], blob[cut:]
    else:
        train, val = b"".join(train_parts), b"".join(val_parts)
    if min(len(train), len(val)) < min_bytes:
        raise ValueError(f"--data: {str(root)!r} has too little text ({len(train)} train / {len(val)} validation "
                         f"bytes; need at least {min_bytes} each)")
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731
    source = f"python stdlib ({root})" if default else str(root)
    return Corpus(as_tensor(train), as_tensor(val), source, num_read)


def _windows(data_N: torch.Tensor, starts_B: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx_BS = starts_B[:, None] + torch.arange(seq_len + 1)[None, :]
    tok_BS = data_N[idx_BS].long()
    return tok_BS[:, :-1], tok_BS[:, 1:]


def train_batch(corpus: Corpus, step: int, *, batch_size: int, seq_len: int, seed: int, rank: int = 0,
                world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets, int64 [B, S] each (CPU), of rank ``rank`` at ``step``.

    Windows start uniformly at random inside the rank's contiguous shard of the training bytes; the
    generator is seeded by (seed, step, rank) only. Raises ValueError if a shard is shorter than S + 1.
    """
    n = corpus.train_N.numel()
    lo, hi = rank * n // world_size, (rank + 1) * n // world_size
    if hi - lo < seq_len + 1:
        raise ValueError(f"training text shard of rank {rank} has {hi - lo} bytes, fewer than "
                         f"seq_len + 1 = {seq_len + 1}; use more data or a shorter --seq-len")
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 4099 + rank)
    starts_B = lo + torch.randint(0, hi - lo - seq_len, (batch_size,), generator=g)
    return _windows(corpus.train_N, starts_B, seq_len)


def val_batches(corpus: Corpus, *, num_batches: int, batch_size: int, seq_len: int):
    """A fixed list of ``num_batches`` (inputs, targets) validation batches, int64 [B, S] each (CPU).

    The windows are evenly spaced over the validation bytes (no randomness), the same on every rank.
    """
    n = corpus.val_N.numel()
    if n < seq_len + 1:
        raise ValueError(f"validation text has {n} bytes, fewer than seq_len + 1 = {seq_len + 1}")
    count = num_batches * batch_size
    starts = torch.linspace(0, n - seq_len - 1, count).long()
    return [_windows(corpus.val_N, starts[i * batch_size:(i + 1) * batch_size], seq_len) for i in range(num_batches)]
