"""launch: a real elastic job (supervisor here, two worker processes), watched and waited on."""

import math

import numpy as np
import pytest

import rustytorch
from rustytorch import ConfigError, JobError, RustytorchError

CONFIG = "python/tests/configs/tiny_fashion.toml"


def test_two_workers_train_and_the_checkpoint_loads(repo, data_dir, tmp_path):
    # Goal: the handle reports the real job. Method: two worker processes train 30 steps;
    # status shows the steps and a finite loss, events include both joins and the commits, and
    # the checkpoint the run wrote loads as numpy arrays.
    job = rustytorch.launch(repo / CONFIG, nproc=2, out=tmp_path / "run", data_dir=data_dir)
    assert job.out_dir == tmp_path / "run"
    status = job.wait(timeout=240)
    assert status["done"] and status["phase"] == "finished", status
    assert status["step"] == status["total_steps"] == 30
    assert math.isfinite(status["loss"]) and status["loss"] > 0
    assert status["world"] == 2 and len(status["members"]) == 2
    assert {m["state"] for m in status["members"]} == {"training"}
    assert "accuracy" in " ".join(status["eval"]) or status["eval"], status["eval"]
    events = job.events()
    kinds = [e["event"] for e in events]
    assert kinds.count("joined") == 2, kinds
    assert kinds.count("committed") == 30 and kinds[-1] == "finished"
    assert len({e["pid"] for e in events if e["event"] == "joined"}) == 2
    assert any(e["event"] == "checkpointed" for e in events)

    checkpoint = rustytorch.latest_checkpoint(job.out_dir)
    assert checkpoint is not None, list((job.out_dir / "checkpoints").iterdir())
    tensors, metadata = rustytorch.load_checkpoint(checkpoint, with_metadata=True)
    assert tensors and all(isinstance(a, np.ndarray) for a in tensors.values())
    weights = [a for a in tensors.values() if a.ndim == 2]
    assert {a.shape for a in weights} >= {(32, 784), (10, 32)} or {a.shape for a in weights} >= {(784, 32), (32, 10)}, {k: a.shape for k, a in tensors.items()}
    assert all(np.isfinite(a).all() for a in tensors.values())
    assert metadata


def test_a_failing_job_raises_with_the_rust_message(repo, tmp_path):
    # Goal: a job that cannot run surfaces its Rust error from wait(). Method: an empty data folder.
    empty = tmp_path / "no-data"
    empty.mkdir()
    job = rustytorch.launch(repo / CONFIG, nproc=2, out=tmp_path / "run", data_dir=empty)
    with pytest.raises(JobError, match="fetch-data.sh") as info:
        job.wait(timeout=60)
    assert isinstance(info.value, RustytorchError)
    assert job.done()


def test_a_missing_config_raises(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config .*absent.toml"):
        rustytorch.launch(tmp_path / "absent.toml", nproc=2)


def test_a_malformed_config_raises(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nkind = \"transformer-of-doom\"\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        rustytorch.launch(bad, nproc=2)


@pytest.mark.parametrize("nproc", [0, -1, "2"])
def test_a_bad_nproc_raises(repo, nproc):
    with pytest.raises(ConfigError, match="nproc"):
        rustytorch.launch(repo / CONFIG, nproc=nproc)
