"""The version of ckptctl, and what a manifest records about the tool that wrote it."""

from __future__ import annotations

import platform
from importlib import metadata

__version__ = "0.1.0"


def tool_info() -> dict[str, str]:
    """``{"ckptctl": ..., "torch": ..., "python": ...}``: the ``tool`` entry of every manifest
    ckptctl writes. Torch's version comes from its installed metadata, never from importing it:
    this leaf is imported by the CLI, whose start-up stays torch-free."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "unknown"
    return {"ckptctl": __version__, "torch": torch_version, "python": platform.python_version()}
