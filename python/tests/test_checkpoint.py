"""load_checkpoint: safetensors files as numpy arrays with the file's dtype, and its errors."""

import json
import struct

import numpy as np
import pytest

import rustytorch
from rustytorch import CheckpointError, RustytorchError, load_checkpoint


def write_safetensors(path, tensors, metadata=None):
    """A safetensors file written by hand (8-byte header length, JSON header, data)."""
    header, blobs, offset = {}, [], 0
    for name, (st_dtype, array) in tensors.items():
        raw = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": st_dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def test_file_dtypes_are_kept(tmp_path):
    # Goal: every tensor comes back with the dtype it has in the file, values exact, in name order.
    f32 = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    f16 = np.array([0.5, -2.0, 65504.0], dtype=np.float16)
    i32 = np.array([[1, -2], [3, 2**31 - 1]], dtype=np.int32)
    flags = np.array([True, False, True])
    bf16_bits = np.array([0x3F80, 0xC000], dtype=np.uint16)  # 1.0, -2.0
    path = tmp_path / "typed.safetensors"
    write_safetensors(path, {"w": ("F32", f32), "h": ("F16", f16), "i": ("I32", i32), "m": ("BOOL", flags), "b": ("BF16", bf16_bits)}, {"step": "7"})
    tensors, metadata = load_checkpoint(path, with_metadata=True)
    assert list(tensors) == ["b", "h", "i", "m", "w"]
    assert metadata == {"step": "7"}
    np.testing.assert_array_equal(tensors["w"], f32)
    assert tensors["w"].dtype == np.float32
    assert tensors["h"].dtype == np.float16 and tensors["h"].tolist() == f16.tolist()
    assert tensors["i"].dtype == np.int32 and tensors["i"].tolist() == i32.tolist()
    assert tensors["m"].dtype == np.bool_ and tensors["m"].tolist() == [True, False, True]
    assert tensors["b"].dtype == np.float32 and tensors["b"].tolist() == [1.0, -2.0]


def test_as_torch_keeps_bfloat16(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "b.safetensors"
    write_safetensors(path, {"b": ("BF16", np.array([0x3F80, 0xC000], dtype=np.uint16)), "w": ("F32", np.ones(2, np.float32))})
    tensors = load_checkpoint(path, as_torch=True)
    assert tensors["b"].dtype == torch.bfloat16 and tensors["b"].tolist() == [1.0, -2.0]
    assert tensors["w"].dtype == torch.float32


def test_a_malformed_checkpoint_raises_with_the_rust_message(tmp_path):
    path = tmp_path / "broken.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(CheckpointError, match="not a valid safetensors file") as info:
        load_checkpoint(path)
    assert isinstance(info.value, RustytorchError)
    assert str(path) in str(info.value)


def test_a_wrong_byte_count_names_the_tensor(tmp_path):
    path = tmp_path / "short.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00" * 8)
    with pytest.raises(CheckpointError, match="w"):
        load_checkpoint(path)


def test_a_missing_checkpoint_raises(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "absent.safetensors")
    assert rustytorch.latest_checkpoint(tmp_path) is None
