"""The on-storage names shared by every stage: dtypes, blob keys and the row view of a tensor.

One table, one key pattern, one ``row_shape``: the manifest, the skeleton, the store, leases, the
writer and the DCP path all use these, so a dtype or a key is valid in one place iff in all.
"""
from __future__ import annotations

import math
import re

import torch

# A blob key is a path component in the store (and in lease objects): hex only, nothing else.
BLOB_KEY_RE = re.compile(r"[0-9a-f]{32,64}")

# The dtypes a stored tensor may have (a manifest naming another is refused).
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32",
        "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2",
        "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "complex32",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}

# Every dtype object this torch knows, by name: ``torch.dtype`` values inside a state's skeleton.
# vars() rather than dir()/getattr: no lazy submodule imports, and only real dtype objects.
ALL_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


def dtype_name(dtype: torch.dtype) -> str:
    """The name a manifest records for ``dtype`` (``"float32"``)."""
    return str(dtype).removeprefix("torch.")


def is_blob_key(key: object) -> bool:
    """Whether ``key`` is a well-formed blob key (safe as a path component)."""
    return isinstance(key, str) and BLOB_KEY_RE.fullmatch(key) is not None


def row_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The (rows, cols) view that chunks and row deltas work on: rows = first dim for ndim >= 2."""
    return (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, math.prod(shape))
