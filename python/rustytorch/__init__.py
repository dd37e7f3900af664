"""rustytorch from Python.

- ``launch(config, nproc=2)`` runs an elastic data-parallel job (what ``rtx launch`` runs) and
  returns a :class:`Job` with ``status()``, ``events()`` and ``wait()``.
- ``load_checkpoint(path)`` gives a checkpoint's tensors as numpy arrays (``as_torch=True``: torch
  tensors); ``latest_checkpoint(run_dir)`` finds the newest one of a run.
- :class:`Tensor` is a rustytorch CPU tensor; ``numpy.asarray(t)`` views its memory without a copy.
- ``simulate(scenario, seed=N)`` runs the deterministic simulator for one seed.

Every error of the runtime is a :class:`RustytorchError` (subclasses :class:`ConfigError`,
:class:`CheckpointError`, :class:`JobError`, :class:`SimulationError`) with the Rust message.
"""

from ._rustytorch import (
    CheckpointError,
    ConfigError,
    JobError,
    RustytorchError,
    SimulationError,
)
from .checkpoint import latest_checkpoint, load_checkpoint
from .job import Job, launch
from .sim import simulate
from .tensor import Tensor

__all__ = [
    "CheckpointError",
    "ConfigError",
    "Job",
    "JobError",
    "RustytorchError",
    "SimulationError",
    "Tensor",
    "latest_checkpoint",
    "launch",
    "load_checkpoint",
    "simulate",
]
