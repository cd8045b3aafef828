"""Comparing logprobs computed along different cache paths.

A request that reuses cached pages runs its forward over other shapes than one that computes
the whole prompt, so its float sums may round apart in the last bits (seen on CPUs whose
matmul kernels depend on the shapes, e.g. AVX-512 without AMX). Tokens, ids and texts must
still be equal; logprobs within fp32 noise."""

from __future__ import annotations

import dataclasses
from typing import Any

FP32_NOISE = 1e-4


def nested_close(got: Any, want: Any, tol: float = FP32_NOISE) -> bool:
    """`got == want`, except that floats may differ by `tol`: lists, tuples, dicts and
    dataclasses compared member by member, everything else exactly."""
    if isinstance(want, float) and isinstance(got, float):
        return got == want or abs(got - want) <= tol  # equal infinities too
    if dataclasses.is_dataclass(want) and not isinstance(want, type):
        return type(got) is type(want) and nested_close(dataclasses.astuple(got),
                                                        dataclasses.astuple(want), tol)
    if isinstance(want, (list, tuple)):
        return (isinstance(got, (list, tuple)) and len(got) == len(want)
                and all(nested_close(g, w, tol) for g, w in zip(got, want)))
    if isinstance(want, dict):
        return (isinstance(got, dict) and got.keys() == want.keys()
                and all(nested_close(got[k], want[k], tol) for k in want))
    return got == want
