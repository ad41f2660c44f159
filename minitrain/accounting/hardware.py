"""Accelerator specs: peak FLOP/s by dtype (dense and 2:4-sparse apart), memory, bandwidth.

Every published figure names its source; ``cpu`` is measured here (:func:`measure_cpu`).

>>> h100 = hardware("h100")
>>> h100.peak_flops["bf16"], h100.sparse_flops["bf16"]
(989400000000000.0, 1978800000000000.0)
>>> round(h100.intensity("bf16"))  # accelerator intensity, FLOP per byte (chapter 3.6.3)
295
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from minitrain._cache import cache_dir
from minitrain.errors import UserError

__all__ = ["DTYPE_NAMES", "MAX_AGE_SECONDS", "Hardware", "HardwareError", "backend_peak_flops",
           "cpu_peak_bound", "dtype_name", "hardware", "hardware_for_cuda_device", "hardware_names",
           "measure_cpu"]

# Canonical dtype names and the spellings accepted for each (torch's, less "torch.", and
# numpy's included).
DTYPE_NAMES: dict[str, tuple[str, ...]] = {
    "fp64": ("float64", "double"), "fp32": ("float32", "float"), "tf32": ("tensorfloat32",),
    "bf16": ("bfloat16",), "fp16": ("float16", "half"),
    "fp8": ("float8", "float8_e4m3fn", "float8_e5m2"), "int8": (),
    "fp4": ("float4", "nvfp4", "mxfp4"),
}
_DTYPE_ALIASES = {alias: name for name, aliases in DTYPE_NAMES.items()
                  for alias in (name, *aliases)}


class HardwareError(UserError):
    """An unknown hardware name or dtype."""


def dtype_name(dtype: Any) -> str:
    """The canonical name (``"bf16"``, ``"fp32"``...) of a dtype given as text or torch dtype.

    >>> dtype_name("bfloat16"), dtype_name("fp32")
    ('bf16', 'fp32')
    """
    text = str(dtype).strip().lower().removeprefix("torch.")
    if text in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[text]
    raise HardwareError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_NAMES)}")


def _frozen(mapping: Mapping[str, float]) -> Mapping[str, float]:
    return MappingProxyType({key: float(value) for key, value in mapping.items()})


@dataclass(frozen=True)
class Hardware:
    """One accelerator's published (or measured) limits, per device in SI units: dense
    ``peak_flops`` by dtype name, ``sparse_flops`` with 2:4 structured sparsity (NVIDIA's
    headline figures, never for dense training), ``memory_bytes`` as marketed (80 GB = 80e9).

    >>> hardware("h100").memory_bytes
    80000000000
    """

    name: str
    description: str
    peak_flops: Mapping[str, float]
    sparse_flops: Mapping[str, float]
    memory_bytes: int
    memory_bandwidth: float
    source: str
    measured: bool = False
    details: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def peak(self, dtype: Any = "bf16", *, sparse: bool = False) -> float:
        """Peak FLOP/s in ``dtype``; dense unless ``sparse=True`` (2:4 structured sparsity).

        >>> hardware("a100-80gb").peak("bf16") / 1e12
        312.0
        """
        name = dtype_name(dtype)
        table = self.sparse_flops if sparse else self.peak_flops
        if name not in table:
            raise HardwareError(f"{self.name} has no {'sparse' if sparse else 'dense'} {name} "
                                f"peak; it lists {', '.join(table) or 'none'}")
        return table[name]

    def intensity(self, dtype: Any = "bf16") -> float:
        """Accelerator intensity: dense peak FLOP/s over bytes/s (chapter 3.6.3).

        >>> round(hardware("a100-80gb").intensity("bf16"))
        153
        """
        return self.peak(dtype) / self.memory_bandwidth

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable copy of every field."""
        record = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return record | {key: dict(record[key]) for key in ("peak_flops", "sparse_flops",
                                                            "details")}


_TENSOR_CORE = ("tf32", "bf16", "fp16", "fp8", "int8")
_H100_SXM = {"fp64": 67e12, "fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12,
             "fp8": 1978.9e12, "int8": 1978.9e12}
_A100 = {"fp64": 19.5e12, "fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12,
         "int8": 624e12}
_A100_CORES = ("tf32", "bf16", "fp16", "int8")
_A100_SOURCE = "NVIDIA A100 Tensor Core GPU datasheet (2021)"
# name, product, dense peaks, the dtypes with a 2:4-sparse peak (NVIDIA's sparse figures are
# exactly twice dense), GB, bytes/s, source
_REGISTRY: dict[str, Hardware] = {
    name: Hardware(name, product, _frozen(dense), _frozen({k: 2 * dense[k] for k in sparse}),
                   gb * 10**9, bandwidth, source)
    for name, product, dense, sparse, gb, bandwidth, source in (
        ("h100", "NVIDIA H100 SXM5 80GB", _H100_SXM, _TENSOR_CORE, 80, 3.35e12,
         "NVIDIA H100 Tensor Core GPU datasheet and Hopper architecture whitepaper (2022), SXM5: "
         "dense BF16 989.4 TFLOP/s (1979 with sparsity), 80 GB HBM3 at 3.35 TB/s"),
        ("h100-pcie", "NVIDIA H100 PCIe 80GB",
         {"fp64": 51e12, "fp32": 51e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12,
          "fp8": 1513e12, "int8": 1513e12}, _TENSOR_CORE, 80, 2.0e12,
         "NVIDIA H100 Tensor Core GPU datasheet (2022), PCIe: 80 GB HBM2e at 2.0 TB/s"),
        ("h100-nvl", "NVIDIA H100 NVL 94GB",
         {"fp64": 60e12, "fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12,
          "fp8": 1670.5e12, "int8": 1670.5e12}, _TENSOR_CORE, 94, 3.9e12,
         "NVIDIA H100 Tensor Core GPU datasheet (2023), NVL: 94 GB HBM3 at 3.9 TB/s"),
        ("h200", "NVIDIA H200 SXM 141GB", _H100_SXM, _TENSOR_CORE, 141, 4.8e12,
         "NVIDIA H200 Tensor Core GPU datasheet (2024), SXM: H100 SXM compute, "
         "141 GB HBM3e at 4.8 TB/s"),
        ("a100-40gb", "NVIDIA A100 SXM4 40GB", _A100, _A100_CORES, 40, 1.555e12,
         f"{_A100_SOURCE}: 40 GB HBM2 at 1,555 GB/s"),
        ("a100-80gb", "NVIDIA A100 SXM4 80GB", _A100, _A100_CORES, 80, 2.039e12,
         f"{_A100_SOURCE}: 80 GB HBM2e at 2,039 GB/s"),
        ("b200", "NVIDIA B200 (HGX, 1000 W)",
         {"fp64": 40e12, "fp32": 80e12, "tf32": 1125e12, "bf16": 2250e12, "fp16": 2250e12,
          "fp8": 4500e12, "int8": 4500e12, "fp4": 9000e12}, (*_TENSOR_CORE, "fp4"), 180, 8.0e12,
         "NVIDIA HGX B200 datasheet (2024), per GPU: dense BF16 2.25 PFLOP/s "
         "(4.5 with sparsity), 180 GB HBM3e at 8 TB/s"),
    )
}
_ALIASES = {"h100-sxm": "h100", "a100": "a100-80gb", "h200-sxm": "h200"}
# Words of a torch.cuda.get_device_name, most specific first, and the entry they name.
_CUDA_NAMES = ((("H100", "PCIE"), "h100-pcie"), (("H100", "NVL"), "h100-nvl"), (("H100",), "h100"),
               (("H200",), "h200"), (("B200",), "b200"), (("A100", "40GB"), "a100-40gb"),
               (("A100",), "a100-80gb"))


def hardware_names() -> list[str]:
    """Registered names, ``"cpu"`` (measured) included.

    >>> hardware_names()[:3]
    ['a100-40gb', 'a100-80gb', 'b200']
    """
    return sorted([*_REGISTRY, "cpu"])


def hardware(name: str = "h100") -> Hardware:
    """The spec called ``name`` (see :func:`hardware_names`); ``"cpu"`` is measured here.

    >>> hardware("h200").memory_bandwidth
    4800000000000.0
    >>> hardware("tpu")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    minitrain.accounting.hardware.HardwareError: unknown hardware 'tpu'; choose one of a100, ...
    """
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key == "cpu":
        return measure_cpu()
    if key not in _REGISTRY:
        known = ", ".join(sorted([*_REGISTRY, *_ALIASES, "cpu"]))
        raise HardwareError(f"unknown hardware {name!r}; choose one of {known}")
    return _REGISTRY[key]


def backend_peak_flops(backend: Any) -> float | None:
    """Dense peak FLOP/s of the math a :class:`~minitrain.precision.Backend` runs (for MFU), or
    None if unknown: fp8 on fp8 tensor cores, else its policy's compute format.

    >>> import minitrain as mt
    >>> backend_peak_flops(mt.get_backend("cpu")) == hardware("cpu").peak_flops["fp32"]
    True
    """
    import torch

    from minitrain.precision.backend import on_tensor_cores

    if backend.device.type == "cpu":
        spec = hardware("cpu")
    elif backend.device.type == "cuda" and torch.cuda.is_available():
        spec = hardware_for_cuda_device(torch.cuda.get_device_name(backend.device))
    else:
        return None
    return None if spec is None else spec.peak_flops.get(
        "fp8" if on_tensor_cores(backend.policy) else backend.policy.compute)


def hardware_for_cuda_device(device_name: str) -> Hardware | None:
    """The registry entry for a ``torch.cuda.get_device_name``, None for an unknown device.

    >>> hardware_for_cuda_device("NVIDIA H100 80GB HBM3").name
    'h100'
    >>> hardware_for_cuda_device("NVIDIA A100-SXM4-40GB").name
    'a100-40gb'
    >>> hardware_for_cuda_device("NVIDIA GeForce RTX 4090") is None
    True
    """
    words = set(device_name.upper().replace("-", " ").split())
    return next((_REGISTRY[name] for needed, name in _CUDA_NAMES if words.issuperset(needed)),
                None)


# The CPU, measured: best-of-N timings of torch.mm and of a large copy.
_MATMUL_SIZE = {"fp32": 1024, "bf16": 512, "fp16": 512}
_COPY_BYTES = 64 * 2**20


def _best_seconds(fn: Any) -> float:
    """The fastest of at least 3 timed calls of ``fn`` over 50 ms (after one warm-up)."""
    fn()
    best, spent, repeats = float("inf"), 0.0, 0
    while repeats < 3 or spent < 0.05:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best, spent, repeats = min(best, elapsed), spent + elapsed, repeats + 1
    return best


def _matmul_flops_per_second(torch: Any, dtype: Any, n: int) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    # 2·n³ FLOPs for an n×n by n×n matmul (one multiply and one add per term).
    return 2 * n**3 / _best_seconds(lambda: torch.mm(a, b, out=out))


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _cpuinfo() -> dict[str, str]:
    """The first CPU's fields in ``/proc/cpuinfo`` (empty where there is none)."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
    return fields


def _cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def _max_clock_hz() -> float:
    """cpufreq's maximum clock, else 5 GHz, above the boost clock of the server CPUs that VMs
    (which hide cpufreq) run on. Not /proc/cpuinfo's ``cpu MHz``: the current clock, a VM's
    nominal one, below the clock its matmuls run at (a "2.6 GHz" VM measured MFU 1.1)."""
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) * 1e3
    return 5e9


# fp32 lanes of the widest vector FMA the flags list (x86 ``flags``, Arm ``Features``).
_FP32_LANES = (("avx512f", 16), ("avx", 8), ("sse2", 4), ("asimd", 4))
_FMA_UNITS = 2  # vector FMA pipes per core: the most any x86 or Arm server core has
# bf16 / fp16 rate over fp32 by the extension that runs them (AMX: 1024 FMAs per cycle per core).
_HALF_RATE = {"bf16": (("amx_bf16", 32), ("avx512_bf16", 2)),
              "fp16": (("amx_fp16", 32), ("avx512fp16", 2))}


def cpu_peak_bound(cores: int, flags: set[str] | frozenset[str], clock_hz: float
                   ) -> dict[str, float]:
    """An upper bound of dense FLOP/s on ``cores`` cores from the spec sheet's terms: cores x
    FMA units x SIMD lanes x 2 (an FMA is two FLOPs) x clock, as vendors compute peak FLOP/s.

    >>> cpu_peak_bound(2, {"avx2", "avx", "fma"}, 3e9)["fp32"] / 1e9   # 2 x 2 x 8 x 2 x 3 GHz
    192.0
    """
    lanes = next((n for flag, n in _FP32_LANES if flag in flags), 1)
    fp32 = cores * _FMA_UNITS * lanes * 2 * clock_hz
    half = {name: fp32 * next((k for flag, k in rates if flag in flags), 1)
            for name, rates in _HALF_RATE.items()}
    return {"fp32": fp32, **half}


def _spec_bound(threads: int) -> dict[str, Any]:
    """This process's bound: its torch threads, at most the cores it may run on."""
    info = _cpuinfo()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    cores, clock = min(threads, available), _max_clock_hz()
    return {"cores": cores, "clock_hz": clock, "flops": cpu_peak_bound(cores, flags, clock)}


def _machine_key(torch: Any) -> dict[str, Any]:
    """What the figures depend on: the machine, the torch build and its thread count."""
    threads = torch.get_num_threads()
    return {"cpu": _cpu_model(), "host": platform.node(), "logical_cpus": os.cpu_count(),
            "memory_bytes": _physical_memory_bytes(), "torch": torch.__version__,
            "torch_git": torch.version.git_version, "threads": threads,
            "bound": _spec_bound(threads)}


def _cache_path(key: Mapping[str, Any]) -> Path | None:
    """The file in minitrain's cache folder (none when ``MINITRAIN_CACHE_DIR=off``)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = cache_dir()
    return None if root is None else root / f"hardware-cpu-{digest}.json"


def _fresh(spec: Hardware | None, key: Mapping[str, Any]) -> bool:
    """Measured with this key at most :data:`MAX_AGE_SECONDS` ago, with every dtype the probe
    measures."""
    if spec is None or spec.details.get("key") != dict(key) or not (
            set(_MATMUL_SIZE) <= set(spec.peak_flops)):
        return False
    measured_at = spec.details.get("measured_unix")
    return measured_at is not None and 0 <= time.time() - float(measured_at) <= MAX_AGE_SECONDS


def _load_cached(path: Path | None) -> Hardware | None:
    if path is None or not path.is_file():
        return None
    try:
        r = json.loads(path.read_text())
        return Hardware(**r | {"peak_flops": _frozen(r["peak_flops"]), "details": MappingProxyType(
            r["details"]), "sparse_flops": _frozen(r["sparse_flops"])})
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable or an older layout: measure again


def _measure(torch: Any, key: Mapping[str, Any]) -> Hardware:
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    measured = {name: _matmul_flops_per_second(torch, dtypes[name], n)
                for name, n in _MATMUL_SIZE.items()}
    # The peak for MFU is one no step can exceed: the spec bound (a timing under load is low).
    peaks = {name: max(key["bound"]["flops"][name], value) for name, value in measured.items()}
    src, dst = torch.ones(_COPY_BYTES // 4), torch.empty(_COPY_BYTES // 4)
    # A copy reads and writes every byte once: 2 × nbytes moved.
    bandwidth = 2 * _COPY_BYTES / _best_seconds(lambda: dst.copy_(src))
    try:  # the 1-minute load average: a busy machine measures low
        load = round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        load = None
    now = time.time()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now))
    busy = "" if load is None else f", 1-min load {load:g} on {key['logical_cpus']} CPUs"
    bound = key["bound"]
    source = (f"peak FLOP/s: {bound['cores']} cores x FMA units x SIMD lanes x 2 x "
              f"{bound['clock_hz'] / 1e9:g} GHz (an upper bound); bandwidth measured {stamp} "
              f"with torch {key['torch']}{busy}: a {_COPY_BYTES // 2**20} MiB copy (read + write)")
    details = {"key": dict(key), "measured_at": stamp, "measured_unix": now, "load_average": load,
               "measured_matmul_flops": measured}
    return Hardware("cpu", f"{key['cpu']} ({key['threads']} torch threads)", _frozen(peaks),
                    _frozen({}), _physical_memory_bytes(), bandwidth, source, True,
                    MappingProxyType(details))


# A week: a measurement taken while the machine was busy does not stick for good.
MAX_AGE_SECONDS = 7 * 86_400
_MEASURED: dict[str, Hardware] = {}


def measure_cpu(refresh: bool = False) -> Hardware:
    """This CPU for this process: peak FLOP/s in fp32, bf16 and fp16 bounded from the spec
    (:func:`cpu_peak_bound` on ``torch.get_num_threads()`` cores; at least the measured
    ``torch.mm`` rate), so MFU stays at most 1; copy bandwidth (bytes/s) measured. Reused on the
    same machine, torch build and thread count for :data:`MAX_AGE_SECONDS` (kept in memory and
    on disk, ``details`` says what and when); ``refresh=True`` measures again.

    >>> MAX_AGE_SECONDS / 86_400  # days a measurement is reused by default
    7.0
    """
    import torch  # the only torch import in the napkin layer, deferred to this call

    key = _machine_key(torch)
    path = _cache_path(key)
    memo = json.dumps(key, sort_keys=True)
    if not refresh:
        for cached in (_MEASURED.get(memo), _load_cached(path)):
            if _fresh(cached, key):
                _MEASURED[memo] = cached
                return cached
    spec = _measure(torch, key)
    if path is not None:  # unwritable (a read-only home, a full disk): measured again next time
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(json.dumps(spec.to_dict(), indent=1))
            os.replace(temporary, path)
        except OSError:
            with contextlib.suppress(OSError):
                temporary.unlink(missing_ok=True)
    _MEASURED[memo] = spec
    return spec
