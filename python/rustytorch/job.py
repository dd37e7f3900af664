"""Launch an elastic job from Python and watch it: :func:`launch` and :class:`Job`."""

import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from . import _rustytorch
from ._data import PathLike, data_dir as _data_dir


class Job:
    """A running (or ended) job started by :func:`launch`.

    The job runs on a background thread of this process (the supervisor) and in ``nproc`` worker
    processes; this object only reads its state.
    """

    def __init__(self, handle: "_rustytorch.JobHandle"):
        self._handle = handle

    @property
    def out_dir(self) -> Path:
        """The output folder: metrics.jsonl, events.jsonl, summary.json, loss.png, checkpoints/."""
        return Path(self._handle.out_dir)

    def status(self) -> Dict[str, Any]:
        """The job's state, as the live page shows it.

        Keys: ``phase`` (waiting, training, recovering, finished, failed), ``step`` (steps
        committed), ``total_steps``, ``generation``, ``world``, ``loss`` (last committed step),
        ``members`` (dicts: name, pid, host, state, rank), ``counters``, ``eval``, ``failure``,
        ``loss_curve`` ([steps, mean loss] pairs) and ``done``.
        """
        snapshot = json.loads(self._handle._status_json())
        summary = snapshot["summary"]
        return {
            "phase": summary["phase"],
            "step": summary["step"],
            "total_steps": snapshot["info"]["total_steps"],
            "generation": summary["generation"],
            "world": summary["world"],
            "loss": summary["loss"],
            "throughput": summary["throughput"],
            "members": snapshot["members"],
            "counters": summary["counters"],
            "eval": summary["eval"],
            "failure": summary["failure"],
            "loss_curve": snapshot["loss"],
            "done": self._handle.done(),
        }

    def events(self) -> List[Dict[str, Any]]:
        """Every event so far, as ``events.jsonl`` has it: ``{"t": seconds, "event": "joined", ...}``
        (joined, refused, lost, generation, committed, checkpointed, checkpoint_failed, finished,
        failed, suspect)."""
        return json.loads(self._handle._events_json())

    def wait(self, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Blocks until the job ends (the GIL released; Ctrl-C interrupts the wait, not the job).

        Returns :meth:`status` once it ended. Raises :class:`JobError` with the Rust message when
        the job failed, and :class:`TimeoutError` when ``timeout`` seconds passed first.
        """
        if not self._handle._wait(timeout):
            raise TimeoutError(f"the job did not end within {timeout} s")
        return self.status()

    def done(self) -> bool:
        """Whether the job has ended."""
        return self._handle.done()

    def __repr__(self) -> str:
        s = self.status()
        return f"<rustytorch.Job {s['phase']} step {s['step']}/{s['total_steps']} out={self.out_dir}>"


def launch(
    config: PathLike,
    nproc: int = 2,
    *,
    out: Optional[PathLike] = None,
    steps: Optional[int] = None,
    data_dir: Optional[PathLike] = None,
    resume: bool = False,
    min_workers: Optional[int] = None,
    max_workers: Optional[int] = None,
    http: Optional[str] = None,
) -> Job:
    """Starts ``config`` (a TOML file like ``configs/fashion_mlp.toml``) as an elastic
    data-parallel job on ``nproc`` local worker processes, as ``rtx launch`` does, and returns
    at once.

    ``out``: output folder (default: the config's ``[output] dir``); ``steps``: stop after that
    many steps (with a checkpoint); ``data_dir``: the data folder (default ``$RTX_DATA_DIR``, else
    ``./data``); ``http``: serve the live page on that address (``"127.0.0.1:0"``).
    Raises :class:`ConfigError` for a config that cannot be read or a bad ``nproc``.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int):
        raise _rustytorch.ConfigError(f"nproc must be an int, got {nproc!r}")
    handle = _rustytorch.launch(
        os.fspath(config),
        nproc,
        sys.executable,
        ["-m", "rustytorch._worker"],
        out=None if out is None else os.fspath(out),
        steps=steps,
        data_dir=str(_data_dir(data_dir)),
        resume=resume,
        min_workers=min_workers,
        max_workers=max_workers,
        http=http,
    )
    return Job(handle)
