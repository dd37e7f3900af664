"""rustytorch CPU tensors and numpy: :class:`Tensor`.

``numpy.asarray(t)`` (and ``t.numpy()`` for every dtype but bfloat16) is a writable view of the
Rust storage through the buffer protocol: no copy, and the array keeps the storage alive.
``Tensor.from_numpy(a)`` shares ``a``'s memory like ``torch.from_numpy``: writes on either side
are seen on the other, and the tensor keeps ``a``'s memory alive. A read-only array is copied once
(Rust in-place ops must not write into it), as is a non-contiguous one (made contiguous first).
"""

import numpy as np

from . import _rustytorch

Tensor = _rustytorch.Tensor

_RUST_DTYPES = (np.float32, np.float64, np.uint32, np.int64)


def _from_numpy(array) -> "Tensor":
    """A Rust tensor over ``array``'s memory (float32, float64, uint32 or int64; other dtypes are
    refused rather than silently converted). Shared without a copy when ``array`` is writable and
    C-contiguous, copied otherwise (see the module doc)."""
    a = np.asarray(array)
    if a.dtype.type not in _RUST_DTYPES:
        raise TypeError(f"a rustytorch Tensor holds float32, float64, uint32 or int64, not {a.dtype} (convert with .astype first)")
    return Tensor._from_buffer(np.ascontiguousarray(a), list(a.shape))


def _numpy(self) -> np.ndarray:
    """The tensor as a numpy array: a view without a copy, except bfloat16 (numpy has no
    bfloat16), which is converted to a new float32 array (exactly)."""
    if self.dtype == "bfloat16":
        return np.asarray(self.to_float32())
    return np.asarray(self)


Tensor.from_numpy = staticmethod(_from_numpy)
Tensor.numpy = _numpy
