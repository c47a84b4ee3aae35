"""Input validation shared by the ops: every mismatch is an error that names the argument and the fix."""

from __future__ import annotations

import torch

from farsight.errors import InputError, InputTypeError


def check_tensor(name: str, x: object, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise InputError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    return x


def check_float(name: str, x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise InputTypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def check_same_dtype_device(named: dict[str, torch.Tensor]) -> None:
    """All tensors share one dtype and one device (no silent casts or transfers)."""
    items = list(named.items())
    first_name, first = items[0]
    for name, x in items[1:]:
        if x.dtype != first.dtype:
            raise InputTypeError(
                f"{name} has dtype {x.dtype} but {first_name} has {first.dtype}; cast them to one dtype"
            )
        if x.device != first.device:
            raise InputError(f"{name} is on {x.device} but {first_name} is on {first.device}; move them to one device")


def check_side_input(name: str, x: torch.Tensor, q: torch.Tensor) -> None:
    """A side input (GCA's `weight`, ALiBi slopes) next to q: floating, on q's device, and in q's
    dtype or fp32. The ops use it in their compute dtype (fp32, fp64 for fp64 q), so fp32 weights
    from an fp32 softmax go with q of any dtype without being rounded."""
    check_float(name, x)
    allowed = sorted({str(q.dtype), str(torch.float32)})
    if str(x.dtype) not in allowed:
        raise InputTypeError(f"{name} has dtype {x.dtype} but q has {q.dtype}; cast {name} to {' or '.join(allowed)}")
    if x.device != q.device:
        raise InputError(f"{name} is on {x.device} but q is on {q.device}; move them to one device")


def check_shape(name: str, x: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    """`expected` may hold -1 for dimensions that are free."""
    ok = x.dim() == len(expected) and all(e == -1 or e == s for e, s in zip(expected, x.shape))
    if not ok:
        want = "[" + ", ".join("*" if e == -1 else str(e) for e in expected) + "]"
        raise InputError(f"{name} must have shape {want} ({what}), got {list(x.shape)}")


def check_positive_int(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name} must be an integer >= 1, got {value!r}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the CPU paths: float64 stays float64, everything else runs in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
