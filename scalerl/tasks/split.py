"""The training / held-out split of a task's prompts: sharing no prompt, and no prompt text,
between the two, so the held-out curve measures generalisation and not recall.

A prompt text is represented by an 8-byte blake2b digest (`text_digests`), the only
per-row trace of it a task keeps. The seeded order is a keyed hash (`seeded_keys`):
sorting by it is a seeded shuffle that every process computes alike, whatever its Python
hash seed or numpy version, and a text's place in it depends on the text alone, not on
the row order of the file. Two distinct texts with one digest (probability about
n^2 / 2^65 for n texts) would count as duplicates.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

DIGEST_BYTES = 8
_MASK = (1 << 64) - 1


def text_digest(text: str) -> bytes:
    """The 8-byte blake2b digest of `text` (UTF-8); its little-endian uint64 is the key."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=DIGEST_BYTES).digest()


def text_digests(texts: Iterable[str]) -> np.ndarray:
    """`text_digest` of every text, as a uint64 array [n] in the order given."""
    joined = b"".join(text_digest(t) for t in texts)
    return np.frombuffer(joined, dtype="<u8").astype(np.uint64)


def seeded_keys(keys: np.ndarray, seed: int) -> np.ndarray:
    """Sort keys [n] uint64 of `keys` [n] uint64 under `seed` (any int).

    The splitmix64 finaliser of key XOR a digest of the seed: a bijection of uint64, so
    distinct keys never tie, and a seeded shuffle once sorted (Steele et al., "Fast
    splittable pseudorandom number generators", OOPSLA 2014).
    """
    salt = np.uint64(int.from_bytes(text_digest(f"seed:{seed}"), "little") & _MASK)
    z = np.asarray(keys, dtype=np.uint64) ^ salt
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def seeded_order(size: int, seed: int, count: int) -> np.ndarray:
    """The first `count` of the row numbers 0..size-1 in their seeded shuffle, int64.

    A prefix of the full shuffle: a larger count gives the same rows first, so a caller
    may ask for more as it goes. Raises ValueError for a count outside [0, size].
    """
    if not 0 <= count <= size:
        raise ValueError(f"count must be in [0, {size}], got {count}")
    keys = seeded_keys(np.arange(size, dtype=np.uint64), seed)
    if count < size:
        part = np.argpartition(keys, count)[:count]
    else:
        part = np.arange(size)
    return part[np.argsort(keys[part], kind="stable")].astype(np.int64)


@dataclass(frozen=True)
class Split:
    """Row numbers of a split, each int64 and increasing.

    duplicates: rows dropped because their text repeats an earlier row of the same split;
    overlap: training rows dropped because their text is a held-out text.
    """

    train: np.ndarray
    heldout: np.ndarray
    duplicates: int = 0
    overlap: int = 0


def _first_of_each_text(digests: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The rows of `rows` that are the first with their digest (increasing)."""
    _, first = np.unique(digests[rows], return_index=True)
    return np.sort(rows[first])


def seeded_split(digests: np.ndarray, heldout_size: int, seed: int) -> Split:
    """A seeded i.i.d. split of rows by their prompt-text digests [n] uint64.

    One row per distinct text is kept (its first; the others are dropped and counted as
    duplicates); the distinct texts, in their seeded shuffle, give `heldout_size` held-out
    prompts and the rest train. Raises ValueError when heldout_size is outside
    [1, distinct texts - 1] (the message names heldout_size and the range).
    """
    digests = np.asarray(digests, dtype=np.uint64)
    distinct, first = np.unique(digests, return_index=True)
    count = len(distinct)
    if not 1 <= heldout_size <= count - 1:
        raise ValueError(
            f"heldout_size must be in [1, {count - 1}] for the {count} distinct prompts, "
            f"got {heldout_size}"
        )
    keys = seeded_keys(distinct, seed)
    held = np.zeros(count, dtype=bool)
    held[np.argpartition(keys, heldout_size - 1)[:heldout_size]] = True
    return Split(
        train=np.sort(first[~held]).astype(np.int64),
        heldout=np.sort(first[held]).astype(np.int64),
        duplicates=len(digests) - count,
    )


def given_split(digests: np.ndarray, train: np.ndarray, heldout: np.ndarray) -> Split:
    """The split a file gives (masks [n] bool of its training and held-out rows), made
    text-disjoint: one row per distinct text within each split (duplicates dropped and
    counted), and training rows whose text is held out dropped (counted as overlap).

    Either side may come back empty; the caller says which field caused it.
    """
    digests = np.asarray(digests, dtype=np.uint64)
    held_rows = np.flatnonzero(heldout)
    train_rows = np.flatnonzero(train)
    kept_held = _first_of_each_text(digests, held_rows)
    kept_train = _first_of_each_text(digests, train_rows)
    leaked = np.isin(digests[kept_train], digests[kept_held])
    duplicates = len(held_rows) - len(kept_held) + len(train_rows) - len(kept_train)
    return Split(
        train=kept_train[~leaked].astype(np.int64),
        heldout=kept_held.astype(np.int64),
        duplicates=duplicates,
        overlap=int(leaked.sum()),
    )


def split_texts(texts: Sequence[str], heldout_size: int, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) indices into `texts` of `seeded_split`, for a task that holds its
    prompts in memory. Raises ValueError as `seeded_split` does."""
    split = seeded_split(text_digests(texts), heldout_size, seed)
    return split.train.tolist(), split.heldout.tolist()
