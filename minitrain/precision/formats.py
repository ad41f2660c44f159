"""Number formats from fp32 down to NVFP4: their layouts, ranges and encodings, by name.

Element formats by their sign, exponent and mantissa bits (IEEE 754 layout); block formats
with a shared scale per block: MXFP8 and MXFP4 (OCP MX v1.0: 32 elements, an e8m0 scale) and
NVFP4 (NVIDIA: 16 fp4 elements, an e4m3 block scale and an fp32 tensor scale). No torch.

>>> import minitrain as mt
>>> mt.precision.spec("fp16").max, mt.precision.spec("fp8_e4m3").max
(65504.0, 448.0)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["FormatSpec", "FORMATS", "spec"]

# How an element format spends its all-ones exponent field.
IEEE = "ieee"  # exponent all ones: infinities (mantissa 0) and NaNs (IEEE 754)
FN = "fn"  # "finite": only S.1111.111 is NaN, no infinities (FP8 Formats for Deep Learning, 2022)
FINITE = "finite"  # every code is a finite number (OCP MX fp6/fp4)
UNSIGNED_POW2 = "e8m0"  # unsigned power of two, 0xFF is NaN (OCP MX scale format)


@dataclass(frozen=True)
class FormatSpec:
    """One number format: its layout, range and special encodings (for a block format, those
    of its elements, and ``block_size``, ``scale_format`` and ``tensor_scale``)."""

    name: str
    bits: int  # bits per element code
    exponent_bits: int
    mantissa_bits: int
    bias: int
    max: float  # largest finite value
    min_normal: float
    min_subnormal: float
    epsilon: float  # distance from 1 to the next larger value
    inf: str | None  # encoding of infinity, None if the format has none
    nan: str | None  # encoding of NaN, None if the format has none
    signed: bool = True
    special: str = IEEE  # how the all-ones exponent is spent: IEEE, FN, FINITE or UNSIGNED_POW2
    block_size: int | None = None
    scale_format: str | None = None
    tensor_scale: bool = False
    storage_bits: int | None = None  # bits a value occupies in memory, when not ``bits``
    element: str | None = None  # element format of a block format
    torch_dtype: str | None = None  # the matching torch dtype, where torch has one
    source: str = ""

    @property
    def bits_per_element(self) -> float:
        """Storage bits per value, block scales included (per-tensor scale not counted).

        >>> spec("nvfp4").bits_per_element, spec("mxfp4").bits_per_element
        (4.5, 4.25)
        """
        stored = self.storage_bits or self.bits
        if self.block_size is None or self.scale_format is None:
            return float(stored)
        return stored + spec(self.scale_format).bits / self.block_size

    @property
    def is_block(self) -> bool:
        return self.block_size is not None


def _element_spec(name: str, exponent_bits: int, mantissa_bits: int, special: str,
                  torch_dtype: str | None, source: str,
                  storage_bits: int | None = None) -> FormatSpec:
    """Derive range and encodings of a sign/exponent/mantissa format from its layout."""
    bias = 2 ** (exponent_bits - 1) - 1  # IEEE 754 bias
    top = 2**exponent_bits - 1  # the all-ones exponent field
    emin = 1 - bias
    if special == IEEE:  # the all-ones exponent is reserved for inf and NaN
        emax, largest_fraction = top - 1 - bias, 2 - 2.0**-mantissa_bits
        inf, nan = "exponent all ones, mantissa 0", "exponent all ones, mantissa non-zero"
    elif special == FN:  # only exponent and mantissa all ones is NaN
        emax, largest_fraction = top - bias, 2 - 2.0 ** (1 - mantissa_bits)
        inf, nan = None, "exponent and mantissa all ones"
    else:  # every code is finite
        emax, largest_fraction = top - bias, 2 - 2.0**-mantissa_bits
        inf, nan = None, None
    return FormatSpec(
        name, 1 + exponent_bits + mantissa_bits, exponent_bits, mantissa_bits, bias,
        max=largest_fraction * 2.0**emax, min_normal=2.0**emin,
        min_subnormal=2.0 ** (emin - mantissa_bits), epsilon=2.0**-mantissa_bits, inf=inf,
        nan=nan, special=special, storage_bits=storage_bits, torch_dtype=torch_dtype,
        source=source,
    )


# An unsigned power of two: the OCP MX block scale.
_E8M0 = FormatSpec(
    "e8m0", 8, 8, 0, 127, max=2.0**127, min_normal=2.0**-127, min_subnormal=2.0**-127,
    epsilon=1.0, inf=None, nan="0xFF", signed=False, special=UNSIGNED_POW2,
    torch_dtype="float8_e8m0fnu", source="OCP Microscaling Formats (MX) v1.0, 5.4.1",
)


def _block_spec(name: str, element: FormatSpec, block: int, scale: str, tensor_scale: bool,
                source: str) -> FormatSpec:
    return replace(element, name=name, torch_dtype=None, storage_bits=element.bits,
                   block_size=block, scale_format=scale, tensor_scale=tensor_scale,
                   element=element.name, source=source)


def _build_formats() -> dict[str, FormatSpec]:
    ocp = "OCP Microscaling Formats (MX) v1.0"
    elements = [
        _element_spec("fp32", 8, 23, IEEE, "float32", "IEEE 754 binary32"),
        _element_spec("tf32", 8, 10, IEEE, None, "NVIDIA A100 TensorFloat-32", storage_bits=32),
        _element_spec("fp16", 5, 10, IEEE, "float16", "IEEE 754 binary16"),
        _element_spec("bf16", 8, 7, IEEE, "bfloat16", "Google Brain bfloat16"),
        _element_spec("fp8_e4m3", 4, 3, FN, "float8_e4m3fn", "FP8 Formats for Deep Learning"),
        _element_spec("fp8_e5m2", 5, 2, IEEE, "float8_e5m2", "FP8 Formats for Deep Learning"),
        _element_spec("fp6_e2m3", 2, 3, FINITE, None, ocp),
        _element_spec("fp6_e3m2", 3, 2, FINITE, None, ocp),
        _element_spec("fp4_e2m1", 2, 1, FINITE, "float4_e2m1fn_x2", ocp),
        _E8M0,
    ]
    table = {s.name: s for s in elements}
    blocks = [
        _block_spec("mxfp8", table["fp8_e4m3"], 32, "e8m0", False, ocp),
        _block_spec("mxfp4", table["fp4_e2m1"], 32, "e8m0", False, ocp),
        _block_spec("nvfp4", table["fp4_e2m1"], 16, "fp8_e4m3", True,
                    "NVIDIA NVFP4; torchao nvfp4_tensor"),
    ]
    table.update({s.name: s for s in blocks})
    return table


FORMATS: dict[str, FormatSpec] = _build_formats()


def spec(name: str | FormatSpec) -> FormatSpec:
    """The :class:`FormatSpec` of a format by name.

    >>> s = spec("bf16")
    >>> (s.bits, s.exponent_bits, s.mantissa_bits, s.bias, s.epsilon)
    (16, 8, 7, 127, 0.0078125)
    """
    if isinstance(name, FormatSpec):
        return name
    if name not in FORMATS:
        raise ValueError(f"unknown number format {name!r}; choose one of: {', '.join(FORMATS)}")
    return FORMATS[name]
