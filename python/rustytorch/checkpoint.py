"""Checkpoints as numpy arrays or torch tensors: :func:`load_checkpoint`, :func:`latest_checkpoint`."""

import os
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np

from . import _rustytorch
from ._data import PathLike


def load_checkpoint(path: PathLike, *, as_torch: bool = False, with_metadata: bool = False):
    """The tensors of a checkpoint, ``{name: array}`` in name order.

    ``path`` is a safetensors file (``rtx train`` / ``rtx launch`` write
    ``<out>/checkpoints/step-*.safetensors``) or a sharded checkpoint folder. Arrays keep the
    file's dtype; bfloat16, which numpy lacks, becomes float32 (exactly). An array whose file
    dtype is what Rust stores (float32, float64, uint32, int64) is a view of the loaded tensor,
    not a copy. ``as_torch=True`` gives torch tensors (sharing that memory; bfloat16 stays
    bfloat16), and needs torch. ``with_metadata=True`` returns ``(tensors, metadata)``, the
    metadata being the file's string map (step, config, ...).
    Raises :class:`CheckpointError` with the Rust message for a missing or malformed checkpoint.
    """
    torch = None
    if as_torch:
        try:
            import torch  # noqa: F811
        except ImportError as e:
            raise ImportError("load_checkpoint(as_torch=True) needs torch: pip install torch") from e
    entries, metadata = _rustytorch.load_checkpoint(os.fspath(path))
    out: Dict[str, Any] = {}
    for name, tensor, file_dtype in entries:
        array = tensor.numpy()
        if file_dtype not in ("bfloat16", str(array.dtype)):
            array = array.astype(file_dtype)
        if torch is not None:
            value = torch.from_numpy(array)
            if file_dtype == "bfloat16":
                value = value.to(torch.bfloat16)
            out[name] = value
        else:
            out[name] = array
    return (out, metadata) if with_metadata else out


def latest_checkpoint(run_dir: PathLike) -> Optional[Path]:
    """The newest checkpoint under ``<run_dir>/checkpoints`` (highest step), or None."""
    found = _rustytorch.latest_checkpoint(os.fspath(run_dir))
    return None if found is None else Path(found)
