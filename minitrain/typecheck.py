"""Runtime shape checks: jaxtyping annotations enforced by beartype.

Public functions are decorated with :func:`typechecked`. Checks are on by default and
switched off with the environment variable ``MINITRAIN_TYPECHECK=0`` (read at import).
Under the test suite, jaxtyping's import hook checks every function in the package.

>>> import torch
>>> from minitrain.typecheck import typechecked, Float, Tensor
>>> @typechecked
... def first_row(x: Float[Tensor, "rows cols"]) -> Float[Tensor, " cols"]:
...     return x[0]
>>> first_row(torch.ones(2, 3)).shape
torch.Size([3])
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from beartype import beartype
from jaxtyping import Bool, Float, Int, Integer, Num, Shaped, TypeCheckError, jaxtyped
from torch import Tensor

__all__ = ["ENABLED", "Bool", "Float", "Int", "Integer", "Num", "Shaped", "Tensor",
           "TypeCheckError", "typechecked"]

_OFF = {"0", "false", "no", "off"}
ENABLED: bool = os.environ.get("MINITRAIN_TYPECHECK", "1").strip().lower() not in _OFF

F = TypeVar("F", bound=Callable[..., Any])


def typechecked(fn: F) -> F:
    """Check ``fn``'s jaxtyping annotations with beartype on every call (not while compiling)."""
    if not ENABLED:
        return fn
    checked = jaxtyped(typechecker=beartype)(fn)

    @functools.wraps(fn)
    def check_unless_compiling(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        return checked(*args, **kwargs)

    return check_unless_compiling  # type: ignore[return-value]
