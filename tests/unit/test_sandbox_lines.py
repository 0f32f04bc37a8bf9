"""The sandbox caller's line reader (`scalerl.sandbox.runner._Lines`): lines split
across chunks come back whole and in order, a last line without a newline comes back at
the end, and the byte cap closes the channel."""

from __future__ import annotations

import os

from scalerl.sandbox.runner import _Lines


def _read_all(chunks: list[bytes], cap: int = 1 << 30) -> tuple[list[bytes], bool]:
    """The lines `_Lines` gives for `chunks` written one read at a time; and whether the
    channel stayed open to the end (False: the cap closed it)."""
    r, w = os.pipe()
    lines = _Lines(r, cap)
    out: list[bytes] = []
    try:
        for chunk in chunks:
            os.write(w, chunk)
            out += lines.read()
        os.close(w)
        w = -1
        capped = not lines.open
        while lines.open:
            out += lines.read()
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    return out, not capped


def test_lines_split_across_chunks_come_back_whole() -> None:
    assert _read_all([b"ab", b"c\nde\n", b"f", b"g\n\nh"]) == (
        [b"abc", b"de", b"fg", b"", b"h"],
        True,
    )


def test_a_long_line_in_many_chunks_is_one_line() -> None:
    chunks = [b"x" * 60_000] * 40 + [b"\n"]  # 2.4 MB, within one read each
    lines, _ = _read_all(chunks)
    assert [len(line) for line in lines] == [2_400_000]


def test_the_cap_closes_the_channel() -> None:
    lines, open_to_the_end = _read_all([b"a\n", b"b" * 100], cap=50)
    assert lines == [b"a"] and not open_to_the_end
