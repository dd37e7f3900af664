"""rustytorch.Tensor and numpy: the buffer-protocol view shares the Rust storage (no copy)."""

import gc

import numpy as np
import pytest

from rustytorch import Tensor


def test_numpy_view_shares_the_rust_storage():
    # Goal: np.asarray(t) is a view, not a copy. Method: same data pointer; a write through numpy
    # is read back by Rust, and an in-place Rust op is seen by numpy.
    t = Tensor.zeros([2, 3])
    a = np.asarray(t)
    assert a.shape == (2, 3) and a.dtype == np.float32
    assert a.ctypes.data == t.data_ptr()
    a[0, 1] = 5.0
    assert t.to_list() == [0.0, 5.0, 0.0, 0.0, 0.0, 0.0]
    t.add_(1.0)
    assert a.tolist() == [[1.0, 6.0, 1.0], [1.0, 1.0, 1.0]]
    assert t.numpy().ctypes.data == t.data_ptr()


def test_the_array_keeps_the_storage_alive():
    # Goal: the numpy view may outlive every Python reference to the tensor.
    t = Tensor.from_numpy(np.arange(4, dtype=np.float64))
    a = np.asarray(t)
    del t
    gc.collect()
    _ = [np.ones(1000) for _ in range(100)]
    assert a.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert a.base is not None  # the exporting tensor, held by the array


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint32, np.int64])
def test_from_numpy_keeps_dtype_and_values(dtype):
    src = (np.arange(12).reshape(3, 4) * 3).astype(dtype)
    t = Tensor.from_numpy(src)
    assert t.shape == [3, 4] and t.dtype == np.dtype(dtype).name
    np.testing.assert_array_equal(np.asarray(t), src)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.uint32, np.int64])
def test_from_numpy_shares_memory_both_ways(dtype):
    src = np.arange(6, dtype=dtype).reshape(2, 3)
    t = Tensor.from_numpy(src)
    assert t.shares_foreign_memory()
    assert t.data_ptr() == src.ctypes.data
    src[0, 0] = 40  # numpy writes, Rust reads
    assert t.to_list()[0] == 40
    # A view of the tensor is a view of the array: writes through it land in `src`.
    view = np.asarray(t)
    assert view.ctypes.data == src.ctypes.data
    view[1, 2] = 9
    assert src[1, 2] == 9
    if np.dtype(dtype).kind == "f":  # Rust's arithmetic ops are float-only
        t.add_(1)  # Rust writes in place, numpy reads
        np.testing.assert_array_equal(src, np.array([[41, 2, 3], [4, 5, 10]], dtype=dtype))


def test_from_numpy_keeps_the_array_memory_alive():
    src = np.arange(1 << 16, dtype=np.float32)
    t = Tensor.from_numpy(src)
    del src
    gc.collect()
    _ = np.zeros(1 << 16, dtype=np.float32) + 7  # reuse freed memory, were it freed
    assert t.to_list()[:3] == [0.0, 1.0, 2.0] and t.to_list()[-1] == float((1 << 16) - 1)
    view = np.asarray(t)
    del t
    gc.collect()
    assert view[5] == 5.0


def test_read_only_array_is_copied_and_never_written():
    src = np.arange(4, dtype=np.float64)
    src.setflags(write=False)
    t = Tensor.from_numpy(src)
    assert not t.shares_foreign_memory() and t.data_ptr() != src.ctypes.data
    t.add_(10)
    assert src.tolist() == [0.0, 1.0, 2.0, 3.0] and t.to_list() == [10.0, 11.0, 12.0, 13.0]


def test_non_contiguous_input_is_copied_in_order():
    src = np.arange(12, dtype=np.float32).reshape(3, 4).T
    t = Tensor.from_numpy(src)
    np.testing.assert_array_equal(np.asarray(t), src)
    t.add_(1)
    assert src[0, 0] == 0.0  # the transposed source is not aliased


def test_unsupported_dtype_is_refused():
    with pytest.raises(TypeError, match="float32, float64, uint32 or int64"):
        Tensor.from_numpy(np.zeros(3, dtype=np.float16))


def test_bfloat16_converts_for_numpy_and_has_no_buffer():
    t = Tensor.zeros([2], dtype="bfloat16")
    with pytest.raises(BufferError, match="bfloat16"):
        memoryview(t)
    a = t.numpy()
    assert a.dtype == np.float32 and a.tolist() == [0.0, 0.0]


def test_torch_shares_the_same_memory():
    torch = pytest.importorskip("torch")
    t = Tensor.zeros([4])
    view = torch.from_numpy(np.asarray(t))
    view[2] = 7.0
    assert t.to_list() == [0.0, 0.0, 7.0, 0.0]
    assert view.data_ptr() == t.data_ptr()
