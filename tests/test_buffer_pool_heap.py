"""The pure fast path's recycled buffers come from malloc's heap, not from fresh mmaps (every
fresh mmap puts its data at the same offset in a page; an update whose streams all share it
ran 1.4-1.8x torch's fused step instead of 1.1-1.2x). glibc's own counters say where a
buffer went, in a new process, where nothing has raised glibc's mmap threshold yet."""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys

import pytest

SCRIPT = """
import ctypes, sys, torch
from minitrain.optim import _buffers

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in "arena ordblks smblks hblks hblkhd "
                "usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
if sys.argv[1] == "without":
    _buffers._from_the_heap = lambda nbytes: None
like = torch.empty(1).expand(1024, 1024)  # no storage of its own: the buffer is 4 MiB
pool = _buffers.BufferPool()
pool.begin_update()
before = libc.mallinfo2().hblkhd
(buffer,) = pool([like])
buffer.fill_(1.0)
print(libc.mallinfo2().hblkhd - before, buffer.shape == like.shape, float(buffer.sum()))
"""


def _glibc_with_mallinfo2() -> bool:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    return hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallinfo2")


def _mmapped_bytes(arm: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, arm], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[1:] == ["True", str(float(1024 * 1024))]
    return int(out[0])


@pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_a_new_process_gets_its_first_buffers_from_the_heap():
    assert _mmapped_bytes("with") == 0
    # the control: without the pool's step, glibc maps the buffer on its own
    assert _mmapped_bytes("without") >= 4 * 1024 * 1024
