"""minitrain's C library: ``optim/kernels/_streaming.c`` (the optimizers' one-pass updates,
the global-norm clip's sums of squares, :mod:`minitrain.random`'s Threefry counters, DP-SGD's
private sum), built
with the system C compiler on first use and cached (verified by size and sha256 before
loading). ``MINITRAIN_STREAMING=0`` turns it off, ``=require`` turns a failed build into a
:class:`BuildError` that shows the compiler's output."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from minitrain._cache import cache_dir

SOURCE = Path(__file__).parent / "optim" / "kernels" / "_streaming.c"
ENV = "MINITRAIN_STREAMING"
_I32, _I64, _U32, _PTR = ctypes.c_int, ctypes.c_int64, ctypes.c_uint32, ctypes.c_void_p
_F64 = ctypes.c_double
SIGNATURES = {"minitrain_update": [_I32, _PTR, _I64, _I64, *[_PTR] * 2, *[_I64] * 3, _I32, _I32],
              "minitrain_sumsq": [_PTR, _PTR, _I64, _I32, _PTR],  # each returns an int status
              "minitrain_threefry": [_U32, _U32, _I64, _I64, _I32, _F64, _F64, _PTR, _I32],
              "minitrain_private_sum": [_I64, _I64, *[_PTR] * 5, _F64, _F64, _F64, _I32],
              "minitrain_split_draw": [_U32, _U32, _I64, _I32, _F64, _F64, _PTR, _PTR, _I32]}


class BuildError(RuntimeError):
    """The kernels failed to build or load under ``MINITRAIN_STREAMING=require``."""


def _flags() -> list[str]:
    """AVX2+FMA on x86 CPUs where torch runs AVX2 code, AVX-512F too where it runs AVX-512
    code (whole-cache-line streaming stores)."""
    flags = ["-O3", "-fno-math-errno", "-fPIC", "-shared", "-fopenmp", "-Wno-psabi"]
    capability = ""
    if hasattr(torch.backends, "cpu") and hasattr(torch.backends.cpu, "get_cpu_capability"):
        capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() in {"x86_64", "amd64"}:
        flags += ["-mavx2", "-mfma"] if capability.startswith(("AVX2", "AVX512")) else []
        flags += ["-mavx512f"] if capability.startswith("AVX512") else []
    return flags


def _verified(target: Path) -> bool:
    """Whether ``target`` is the complete library its sidecar (size and sha256) records."""
    try:
        size, digest = target.with_suffix(".sha256").read_text().split()
        return target.stat().st_size == int(size) and \
            hashlib.sha256(target.read_bytes()).hexdigest() == digest
    except (OSError, ValueError):
        return False


def _build(compiler: str, flags: list[str]) -> Path:
    """Compile :data:`SOURCE` once per source, flags and compiler; return the library path.
    The library and the record of its size and sha256 each replace their file whole; a cached
    library that does not match its record (truncated, torn by a crash) is rebuilt, never
    loaded."""
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join([compiler, *flags, platform.machine()]).encode()
    ).hexdigest()[:16]
    target = cache_dir(required=True) / "kernels" / f"streaming-{key}.so"
    target.parent.mkdir(parents=True, exist_ok=True)
    for folder in (target.parent, target.parent.parent):  # a library there is run: ours alone
        found = folder.stat()
        if found.st_uid != os.getuid() or found.st_mode & 0o002:
            raise OSError(f"{folder} is another user's or writable by all; not loading a "
                          f"library from it (set MINITRAIN_CACHE_DIR to a folder of yours)")
    if target.exists() and _verified(target):
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial, record = Path(scratch) / target.name, Path(scratch) / "record"
        subprocess.run([compiler, *flags, str(SOURCE), "-o", str(partial), "-lm"],
                       check=True, capture_output=True, timeout=120)
        data = partial.read_bytes()
        record.write_text(f"{len(data)} {hashlib.sha256(data).hexdigest()}\n")
        os.replace(record, target.with_suffix(".sha256"))
        os.replace(partial, target)
    return target


def _openmp_runtimes() -> set[str] | None:
    """Paths of the OpenMP runtimes mapped into this process (None where the process's
    mappings cannot be read)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps.read().splitlines()]
    except OSError:
        return None
    return {path for path in paths
            if Path(path).name.startswith(("libgomp", "libiomp", "libomp"))}


def _load(path: Path, openmp: bool) -> ctypes.CDLL:
    """Load the library; with OpenMP, refuse one that brings an OpenMP runtime other than
    torch's (mapped since torch's import): a second one oversubscribes the cores and can
    deadlock after fork."""
    before = _openmp_runtimes()
    library = ctypes.CDLL(str(path))
    after = _openmp_runtimes()
    if openmp and before is not None and after is not None and after - before:
        raise OSError(f"{path.name} links an OpenMP runtime other than torch's "
                      f"({sorted(after - before)}; torch's: {sorted(before) or 'none'}); "
                      f"building without OpenMP")
    return library


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The library, built and loaded on first call; None where it is off or does not build or
    load (no compiler: the callers' torch paths stay)."""
    setting = os.environ.get(ENV, "1").strip().lower()
    if setting in {"0", "off", "false", "no"} or sys.platform == "win32":
        return None
    compiler, flags = os.environ.get("CC", "cc"), _flags()
    failures = []  # without OpenMP (Apple clang, another runtime) the kernels run on one thread
    for attempt in (flags, [flag for flag in flags if flag != "-fopenmp"]):
        try:
            library = _load(_build(compiler, attempt), "-fopenmp" in attempt)
            break
        except (OSError, subprocess.SubprocessError) as error:
            output = getattr(error, "stderr", None) or b""  # the compiler's
            failures.append(f"{type(error).__name__}: {error}\n{output.decode(errors='replace')}")
    else:
        if setting == "require":
            raise BuildError(f"{ENV}=require but the streaming kernels did not build or "
                             f"load:\n" + "\n".join(failures))
        return None
    for name, args in SIGNATURES.items():
        getattr(library, name).restype = ctypes.c_int
        getattr(library, name).argtypes = args
    return library
