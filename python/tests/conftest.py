"""Shared fixtures of the Python package's tests: the repository root and its data folder.

The data is the real Fashion-MNIST that ``bash scripts/fetch-data.sh`` puts in ``data/``
(``RTX_DATA_DIR`` overrides it); a missing data folder fails the tests with that command.
"""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def data_dir() -> Path:
    path = Path(os.environ.get("RTX_DATA_DIR", REPO / "data")).absolute()
    if not (path / "fashion-mnist").exists():
        pytest.fail(f"no Fashion-MNIST in {path}: run `bash scripts/fetch-data.sh` first")
    return path
