"""The deterministic simulator by seed: :func:`simulate`."""

import json
import os
from typing import Any, Dict, Optional

from . import _rustytorch
from ._data import PathLike, data_dir as _data_dir


def simulate(scenario: PathLike, seed: int, *, data_dir: Optional[PathLike] = None) -> Dict[str, Any]:
    """Runs one seed of a simulator scenario (``sim/scenarios/elastic_dp.toml``), as
    ``rtx sim --scenario FILE --seed N`` does, and returns its report.

    Keys: ``seed``, ``trace`` (hash of the whole event trace, hex), ``ok``, ``violation`` (None,
    or the broken invariant with its event and the events before it), ``committed``,
    ``total_steps``, ``generations``, ``faults``, ``checks``, ``checksum`` (final parameters, hex),
    ``virtual_time_s``, ``eval``, ... The same seed gives the same report (the wall time is not in
    it). Raises :class:`ConfigError` for a bad scenario, :class:`SimulationError` when the run
    cannot start (missing data, ...).
    """
    return json.loads(_rustytorch.simulate(os.fspath(scenario), seed, str(_data_dir(data_dir))))
