"""The pure fast path's recycled buffers come from malloc's heap, not from fresh mmaps (every
fresh mmap puts its data at the same offset in a page; an update whose buffers were all such
ran 1.4-1.8x torch's fused step instead of 1.1-1.2x), and clearing the pools hands their pages
back. glibc's own counters say where a buffer went, in a new process, where nothing has raised
glibc's mmap threshold yet."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

MALLINFO = """
import ctypes, sys, torch
from minitrain.optim.kernels import pool as _buffers

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in "arena ordblks smblks hblks hblkhd "
                "usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
"""

FIRST_BUFFER = MALLINFO + """
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

CLEARED = """
import sys, torch
from minitrain.optim.kernels import pool as _buffers

def resident_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096

if sys.argv[1] == "without":
    _buffers._glibc().malloc_trim = lambda pad: 0
pool = _buffers.BufferPool()
pool.begin_update()
buffers = pool([torch.empty(1).expand(1024, 1024)] * 8)
for buffer in buffers:
    buffer.fill_(1.0)  # 32 MiB resident
above = torch.ones(64 * 1024)  # a heap block above them: glibc cannot just lower the top
before = resident_bytes()
del buffers, buffer
_buffers.clear_buffer_pools()
print(before - resident_bytes(), float(above.sum()))
"""


def _glibc_with_mallinfo2() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None)
    return hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallinfo2")


def _run(script: str, arm: str) -> list[str]:
    return subprocess.run([sys.executable, "-c", script, arm], capture_output=True, text=True,
                          check=True).stdout.split()


def _mmapped_bytes(arm: str) -> int:
    out = _run(FIRST_BUFFER, arm)
    assert out[1:] == ["True", str(float(1024 * 1024))]
    return int(out[0])


glibc_only = pytest.mark.skipif(not _glibc_with_mallinfo2(),
                                reason="needs glibc >= 2.33 (mallinfo2, malloc_trim)")


@glibc_only
def test_a_new_process_gets_its_first_buffers_from_the_heap():
    # the control: without the pool's step, glibc maps the buffer on its own (unless this
    # environment raised its threshold already: MALLOC_MMAP_THRESHOLD_, another allocator)
    if _mmapped_bytes("without") < 4 * 1024 * 1024:
        pytest.skip("glibc here serves a new process's 4 MiB blocks from its heap already")
    assert _mmapped_bytes("with") == 0


@glibc_only
def test_clearing_the_pools_hands_their_pages_back():
    released, kept = (_run(CLEARED, arm) for arm in ("with", "without"))
    assert released[1] == kept[1] == str(float(64 * 1024))
    assert int(released[0]) >= 24 * 1024 * 1024
    assert int(kept[0]) < 8 * 1024 * 1024  # the control: glibc keeps the free pages itself
