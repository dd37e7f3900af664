"""Where the data folder is: the argument, else ``$RTX_DATA_DIR``, else ``./data`` (as ``rtx``)."""

import os
from pathlib import Path
from typing import Optional, Union

PathLike = Union[str, "os.PathLike[str]"]


def data_dir(given: Optional[PathLike]) -> Path:
    """The data folder a call uses, made absolute (workers run in other folders)."""
    if given is not None:
        return Path(given).absolute()
    env = os.environ.get("RTX_DATA_DIR")
    return Path(env).absolute() if env else Path("data").absolute()
