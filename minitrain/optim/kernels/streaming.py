"""One-pass CPU updates with streaming stores, registered as torch custom ops.

torch's fused optimizer kernels update in place, so a pure update built on them copies params
and state first: two passes over memory. A single pass that writes into fresh buffers still
costs more than the in-place kernel, because a plain store to a line not in cache first reads
it (read for ownership); non-temporal stores skip that read. Neither aten nor inductor emits
them, so this module builds ``_streaming.c`` (the update rules of the torch.optim family) with
the system C compiler on first use, caches the library (verified by size and sha256 before it
is loaded) and exposes it as the ops ``minitrain::stream_update``, ``minitrain::sum_of_squares``
and ``minitrain::decode_div``: torch.compile, fake tensors and the FLOP counter see one op, and
each op has a fake (meta) implementation.

Every tensor is checked before its pointer reaches C (:func:`.checks.check_slots`). The kernels
cover contiguous float32 CPU tensors; ``MINITRAIN_STREAMING=0`` turns them off, ``=require`` turns a
failed build into a :class:`BuildError` that shows the compiler's output.

>>> params, grads = [torch.ones(4)], [torch.full((4,), 2.0)]
>>> hp = [0.5, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]  # SGD: lr, momentum, dampening, wd, nesterov, ...
>>> if usable([*params, *grads]):
...     new_params, _ = update("sgd", hp, [params, grads, None], fresh)
... else:  # no C compiler here: the same result by hand
...     new_params = [params[0] - 0.5 * grads[0]]
>>> new_params[0], params[0]
(tensor([0., 0., 0., 0.]), tensor([1., 1., 1., 1.]))
"""

from __future__ import annotations

import array
import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import SupportsFloat

import torch
from torch import Tensor

from minitrain import _torch
from minitrain.optim.kernels.checks import check_slots, plain_cpu

__all__ = ["RULES", "BuildError", "available", "decode_div", "fresh", "global_norm",
           "sum_of_squares", "usable", "update"]

RULES = {"adam": 0, "sgd": 1, "adagrad": 2, "rmsprop": 3, "nadam": 4, "radam": 5, "adamax": 6,
         "lion": 7, "schedule_free_adamw": 8, "adadelta": 9, "asgd": 10, "rprop": 11}
"""Rule name -> index in ``_streaming.c``'s table."""
HYPERPARAMETERS = {"adam": 10, "sgd": 7, "adagrad": 3, "rmsprop": 7, "nadam": 11, "radam": 12,
                   "adamax": 9, "lion": 7, "schedule_free_adamw": 13, "adadelta": 8, "asgd": 9,
                   "rprop": 9}
"""Rule name -> how many hyperparameters the kernel reads (``_streaming.c`` lists them)."""

STREAMING_BYTES = 80 * 2**20
"""A pure update writes with streaming stores once it touches at least this many bytes (inputs
and outputs together); below, plain stores, whose lines stay in the last-level cache for the
next update. Measured on a 2-core Xeon (260 MB shared L3) for 8-leaf Adam updates: plain
stores 11% faster at 56 MB touched, streaming stores 28% faster at 112 MB and 39% at 224 MB."""

SOURCE = Path(__file__).with_name("_streaming.c")
ENV = "MINITRAIN_STREAMING"


def _enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in {"0", "off", "false", "no"}


def _flags() -> list[str]:
    """Compiler flags: AVX2+FMA on x86 CPUs where torch itself runs AVX2 code, AVX-512F too
    where it runs AVX-512 code (whole-cache-line streaming stores)."""
    flags = ["-O3", "-fno-math-errno", "-fPIC", "-shared", "-fopenmp", "-Wno-psabi"]
    capability = ""
    if hasattr(torch.backends, "cpu") and hasattr(torch.backends.cpu, "get_cpu_capability"):
        capability = torch.backends.cpu.get_cpu_capability()
    x86 = platform.machine().lower() in {"x86_64", "amd64"}
    if x86 and capability.startswith(("AVX2", "AVX512")):
        flags += ["-mavx2", "-mfma"]
    if x86 and capability.startswith("AVX512"):
        flags += ["-mavx512f"]
    return flags


def _cache_dir() -> Path:
    """``$MINITRAIN_CACHE_DIR`` (or ``$XDG_CACHE_HOME/minitrain``), else a temporary folder."""
    root = os.environ.get("MINITRAIN_CACHE_DIR")
    if root is not None and root.strip().lower() in {"", "0", "off", "none"}:
        return Path(tempfile.gettempdir()) / f"minitrain-{os.getuid()}"
    if root is None:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(xdg) / "minitrain")
    return Path(root)


class BuildError(RuntimeError):
    """The kernels failed to build or load under ``MINITRAIN_STREAMING=require``."""


def _required() -> bool:
    return os.environ.get(ENV, "1").strip().lower() == "require"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(target: Path) -> bool:
    """Whether ``target`` is the complete library its sidecar (size and sha256) records."""
    record = target.with_suffix(".sha256")
    try:
        size, digest = record.read_text().split()
        return target.stat().st_size == int(size) and _digest(target) == digest
    except (OSError, ValueError):
        return False


def _write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, rename it over ``path``."""
    fd, scratch = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(scratch, path)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise


def _build(compiler: str, flags: list[str]) -> Path:
    """Compile ``_streaming.c`` once per source, flags and compiler; return the library path.

    The library is written atomically (temporary file, fsync, rename) with a sidecar recording
    its size and sha256; a cached file that does not match its record (truncated, corrupted, or
    written by an interrupted build) is rebuilt, never loaded.
    """
    key = hashlib.sha256(
        SOURCE.read_bytes() + " ".join([compiler, *flags, platform.machine()]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / "kernels" / f"streaming-{key}.so"
    if target.exists() and _verified(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(scratch) / target.name
        subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", str(partial), "-lm"],
            check=True, capture_output=True, timeout=120,
        )
        data = partial.read_bytes()
    # The record goes first: a reader that sees the new library also sees its record.
    record = f"{len(data)} {hashlib.sha256(data).hexdigest()}\n".encode()
    _write_durably(target.with_suffix(".sha256"), record)
    _write_durably(target, data)
    return target


def _openmp_runtimes() -> set[str] | None:
    """Paths of the OpenMP runtimes mapped into this process (Linux; None where the process's
    mappings cannot be read)."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return None
    names = ("libgomp", "libiomp", "libomp")
    return {line.split()[-1] for line in lines
            if any(Path(line.split()[-1]).name.startswith(n) for n in names)}


def _load(path: Path, openmp: bool) -> ctypes.CDLL:
    """Load the library; with OpenMP, check that it runs on torch's own OpenMP runtime (a
    second runtime would oversubscribe the cores and can deadlock after fork)."""
    before = _openmp_runtimes()
    library = ctypes.CDLL(str(path))
    after = _openmp_runtimes()
    # Any runtime the library brought in is not torch's: torch's is mapped since its import
    # (and when torch runs without OpenMP, a runtime of the kernel's own is a second one too).
    if openmp and before is not None and after is not None and after - before:
        raise OSError(
            f"{path.name} links an OpenMP runtime other than torch's "
            f"({sorted(after - before)}; torch's: {sorted(before) or 'none'}); "
            f"building without OpenMP"
        )
    return library


def _describe(error: BaseException) -> str:
    if isinstance(error, subprocess.CalledProcessError):
        output = (error.stderr or b"").decode(errors="replace").strip()
        return f"{' '.join(map(str, error.cmd))} failed:\n{output}"
    return f"{type(error).__name__}: {error}"


@functools.cache
def _library() -> ctypes.CDLL | None:
    if not _enabled() or sys.platform == "win32":
        return None
    compiler, flags = os.environ.get("CC", "cc"), _flags()
    # Without OpenMP (e.g. Apple clang, or a compiler whose runtime is not torch's) the kernels
    # still build, on one thread.
    failures = []
    for attempt in (flags, [flag for flag in flags if flag != "-fopenmp"]):
        try:
            library = _load(_build(compiler, attempt), "-fopenmp" in attempt)
            break
        except (OSError, subprocess.SubprocessError) as error:
            failures.append(_describe(error))
    else:
        if _required():
            raise BuildError(
                f"{ENV}=require but the streaming kernels did not build or load:\n"
                + "\n".join(failures)
            )
        return None  # no compiler, a failed build or load: the fused-kernel path stays
    library.minitrain_update.restype = ctypes.c_int
    library.minitrain_update.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_int, ctypes.c_int,
    ]
    library.minitrain_sumsq.restype = ctypes.c_int
    library.minitrain_sumsq.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
    ]
    library.minitrain_decode_div.restype = ctypes.c_int
    library.minitrain_decode_div.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_int,
    ]
    return library


def fresh(like: list[Tensor]) -> list[Tensor]:
    """New uninitialized buffers shaped like ``like`` (optimizers pass a recycling pool)."""
    return [torch.empty_like(t) for t in like]


def streams(touched_bytes: int) -> bool:
    """Whether a pure update that touches ``touched_bytes`` writes with streaming stores.

    >>> streams(2**30), streams(2**20)
    (True, False)
    """
    return touched_bytes >= STREAMING_BYTES


def available() -> bool:
    """Whether the streaming kernels are built and loaded (building them on first call).

    >>> isinstance(available(), bool)
    True
    """
    return _library() is not None


def watched() -> bool:
    """Whether a ``TorchFunctionMode`` other than torch's default-device one is active: it would
    see (and could act on) the torch calls an update makes between its checks and a kernel
    (the buffers' allocation, the pointers), so the kernels give way to torch's ops.

    >>> watched()
    False
    """
    if not _torch.is_torch_function_mode_enabled():
        return False
    return any(not isinstance(mode, _torch.DeviceContext)
               for mode in _torch.get_current_function_mode_stack())


def quiet() -> bool:
    """Whether no torch mode watches the torch calls made here: a ``TorchDispatchMode`` (the
    accounting ``Counter``, ``FlopCounterMode``, fake tensors) or a ``TorchFunctionMode`` other
    than torch's default-device one. The kernels give way to torch's ops where one does.

    >>> quiet()
    True
    """
    return _torch.get_current_dispatch_mode() is None and not watched()


def usable(tensors: Sequence[Tensor]) -> bool:
    """Whether an update over these tensors can run here: all plain (not subclassed) CPU,
    float32, contiguous tensors, and no ``TorchDispatchMode`` watching (the accounting
    ``Counter`` and ``FlopCounterMode`` count aten ops, which a C kernel would hide from them;
    torch's kernels run instead), nor a ``TorchFunctionMode`` (:func:`watched`).

    >>> usable([torch.ones(2, dtype=torch.bfloat16)])
    False
    """
    if _torch.get_current_dispatch_mode() is not None or watched() \
            or not available():
        return False
    float32, plain = torch.float32, (Tensor, torch.nn.Parameter)
    return all(
        type(t) in plain and t.dtype is float32 and t.is_cpu and not t.requires_grad
        and t.is_contiguous() and not t.is_neg() for t in tensors
    )


def update(rule: str, hyperparameters: Sequence[SupportsFloat],
           slots: Sequence[list[Tensor] | None],
           outputs: Callable[[list[Tensor]], list[Tensor]] | None = None,
           nontemporal: bool | None = None) -> list[list[Tensor] | None]:
    """One update of ``rule`` over lists of leaves; returns the new ``[params, *buffers]``.

    ``slots`` is ``[params, grads, *buffers]`` in the order ``_streaming.c`` documents for the
    rule, ``None`` for a buffer the rule does not use. The results go into ``outputs(like)``
    buffers (streaming stores once the update touches :data:`STREAMING_BYTES`), or, when
    ``outputs`` is None (donation), into the params and buffers themselves. Call
    :func:`usable` first.
    """
    if len(hyperparameters) != HYPERPARAMETERS[rule]:
        raise ValueError(
            f"streaming rule {rule!r} takes {HYPERPARAMETERS[rule]} hyperparameters, got "
            f"{len(hyperparameters)}; pass them in the order _streaming.c documents"
        )
    hp = [float(v) for v in hyperparameters]
    written = [slots[0], *slots[2:]]
    results = [s if s is None or outputs is None else outputs(s) for s in written]
    rows = [*slots, *results]
    check_slots(rows, len(slots[0]))
    if nontemporal is None:
        touched = 4 * sum(p.numel() for p in slots[0]) * (len(rows) - rows.count(None))
        nontemporal = outputs is not None and streams(touched)
    n_in = len(slots)
    inputs = [t for row in rows[:n_in] if row is not None for t in row]
    outs = [t for row in rows[n_in:] if row is not None for t in row]
    present = [int(row is not None) for row in rows]
    torch.ops.minitrain.stream_update(RULES[rule], hp, inputs, outs, present, nontemporal)
    return results


@torch.library.custom_op(
    "minitrain::stream_update", mutates_args=("outputs",), device_types="cpu",
    schema="(int rule, float[] hyperparameters, Tensor[] inputs, Tensor(a!)[] outputs, "
           "int[] present, bool nontemporal) -> ()")
def _stream_update(rule: int, hyperparameters: list[float], inputs: list[Tensor],
                   outputs: list[Tensor], present: list[int], nontemporal: bool) -> None:
    """The C kernel over rows of leaves: ``inputs`` and ``outputs`` hold the present rows one
    after another (``present``: per pointer slot, whether its row is there)."""
    library = _library()
    if library is None:
        raise RuntimeError(f"the streaming kernels are not available; check {ENV} and a C compiler")
    n_rows = len(present)
    n_leaves = (len(inputs) + len(outputs)) // max(1, sum(present))
    tensors = iter([*inputs, *outputs])
    rows = [[next(tensors) for _ in range(n_leaves)] if on else None for on in present]
    check_slots(rows, n_leaves)  # the last guard before raw pointers reach C
    pointers = array.array("Q", [
        0 if row is None else row[leaf].data_ptr() for leaf in range(n_leaves) for row in rows
    ])
    sizes = array.array("q", [t.numel() for t in rows[0]])
    hp = array.array("d", hyperparameters)
    status = library.minitrain_update(
        rule, hp.buffer_info()[0], pointers.buffer_info()[0], sizes.buffer_info()[0], n_leaves,
        n_rows, torch.get_num_threads(), int(nontemporal))
    if status != 0:
        raise RuntimeError(f"streaming update {rule!r} failed with status {status}")


@_stream_update.register_fake
def _(rule, hyperparameters, inputs, outputs, present, nontemporal) -> None:
    return None


def sum_of_squares(leaves: Sequence[Tensor]) -> list[float]:
    """``sum(x * x)`` of each leaf, accumulated in float64 by one pass over all leaves (the
    same for any number of threads). Call :func:`usable` first.

    >>> leaves = [torch.tensor([3.0, 4.0]), torch.tensor([1.0])]
    >>> sum_of_squares(leaves) if usable(leaves) else [25.0, 1.0]
    [25.0, 1.0]
    """
    return torch.ops.minitrain.sum_of_squares(list(leaves)).tolist()


@torch.library.custom_op("minitrain::sum_of_squares", mutates_args=(), device_types="cpu",
                         schema="(Tensor[] leaves) -> Tensor")
def _sum_of_squares(leaves: list[Tensor]) -> Tensor:
    library = _library()
    if library is None:
        raise RuntimeError(f"the streaming kernels are not available; check {ENV} and a C compiler")
    n_leaves = len(leaves)
    check_slots([leaves], n_leaves)
    pointers = array.array("Q", [t.data_ptr() for t in leaves])
    sizes = array.array("q", [t.numel() for t in leaves])
    out = torch.zeros(n_leaves, dtype=torch.float64, device="cpu")
    status = library.minitrain_sumsq(pointers.buffer_info()[0], sizes.buffer_info()[0], n_leaves,
                                     max(1, torch.get_num_threads()), out.data_ptr())
    if status != 0:
        raise RuntimeError(f"streaming sum of squares failed with status {status}")
    return out


@_sum_of_squares.register_fake
def _(leaves):
    return torch.empty(len(leaves), dtype=torch.float64, device="cpu")


def global_norm(leaves: Sequence[Tensor]) -> Tensor:
    """The L2 norm of float32 CPU leaves taken together, a 0-d float32 tensor, in
    ``torch.nn.utils.clip_grad_norm_``'s form: each leaf's norm in float32, then the norm of
    those norms. Each leaf's sum of squares is accumulated in float64 in one pass over all
    leaves (torch accumulates in float32: the two differ by float32 rounding). Call
    :func:`usable` first.

    >>> leaves = [torch.tensor([3.0]), torch.tensor([4.0])]
    >>> global_norm(leaves) if usable(leaves) else torch.tensor(5.0)
    tensor(5.)
    """
    squares = torch.ops.minitrain.sum_of_squares(list(leaves)).to(torch.float32)
    return torch.linalg.vector_norm(squares.sqrt(), 2)


def decode_div(codes: Tensor, table: Tensor, scale: float | Tensor) -> Tensor | None:
    """``table[codes] / scale`` in float32 for a contiguous CPU tensor of one-byte fp8 codes
    (``torch.float8_*`` or ``uint8``) and its format's 256-entry float32 ``table``: what
    ``codes.float() / scale`` gives, bit for bit, in one threaded pass. None when the kernels
    are not available, a ``TorchDispatchMode`` is active, or ``codes`` is not such a tensor:
    the caller takes torch's ops.

    >>> codes = torch.tensor([1.0, -2.0, 448.0]).to(torch.float8_e4m3fn)
    >>> table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    >>> out = decode_div(codes, table, 2.0)
    >>> (out if out is not None else codes.float() / 2.0).tolist()
    [0.5, -1.0, 224.0]
    """
    if isinstance(scale, Tensor) and (type(scale) is not Tensor or scale.numel() != 1
                                      or scale.device.type != "cpu"):
        return None
    if (_library() is None or _torch.get_current_dispatch_mode() is not None
            or type(codes) is not Tensor or type(table) is not Tensor):
        return None
    divisor = float(scale)
    if (not plain_cpu(codes) or codes.element_size() != 1
            or codes.is_floating_point() and codes.dtype not in
            (torch.float8_e4m3fn, torch.float8_e5m2)
            or not plain_cpu(table) or table.dtype is not torch.float32
            or table.numel() != 256):
        return None
    return torch.ops.minitrain.decode_div(codes, table, divisor)


@torch.library.custom_op("minitrain::decode_div", mutates_args=(), device_types="cpu",
                         schema="(Tensor codes, Tensor table, float scale) -> Tensor")
def _decode_div(codes: Tensor, table: Tensor, scale: float) -> Tensor:
    if not (plain_cpu(codes) and codes.element_size() == 1 and plain_cpu(table)
            and table.dtype is torch.float32 and table.numel() == 256):
        raise ValueError("decode_div takes contiguous one-byte CPU codes and a 256-entry "
                         "float32 table")
    out = torch.empty(codes.shape, dtype=torch.float32, device="cpu")
    status = _library().minitrain_decode_div(
        codes.data_ptr(), table.data_ptr(), scale, out.data_ptr(), codes.numel(),
        max(1, torch.get_num_threads()))
    if status != 0:
        raise RuntimeError(f"streaming fp8 decode failed with status {status}")
    return out


@_decode_div.register_fake
def _(codes, table, scale):
    return torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
