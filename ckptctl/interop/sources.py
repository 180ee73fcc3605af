"""Opening another tool's checkpoint, named by its local path and format, as a ``Source``.

The format is what ``layouts.classify`` found at the path (``dcp``, ``safetensors``, ``torch``);
this module only picks the reader that takes it: a DCP directory; a Hugging Face Trainer or
accelerate ``save_state`` directory (their training state carried or listed as dropped), else
plain safetensors; a ``torch.save`` file. The step is what every record of the source agrees on
(its own records and its name: ``interop.steps``). The readers import torch.
"""

from __future__ import annotations

from ckptctl.interop import steps
from ckptctl.interop.base import Source
from ckptctl.interop.detect import Format


def open_foreign(path: str, fmt: Format) -> Source:
    """The checkpoint at the local ``path``, of another tool's format ``fmt``, as a ``Source``."""
    src: Source
    if fmt == "dcp":
        from ckptctl.interop.dcp_io import DcpSource

        src = DcpSource(path)
    elif fmt == "safetensors":
        from ckptctl.interop.accelerate_io import AccelerateSource, is_accelerate_checkpoint
        from ckptctl.interop.hf_trainer_io import HfTrainerSource, is_trainer_checkpoint
        from ckptctl.interop.safetensors_io import SafetensorsSource

        if is_trainer_checkpoint(path):
            src = HfTrainerSource(path)
        else:  # an accelerate save_state directory carries (or lists as dropped) its training state
            src = AccelerateSource(path) if is_accelerate_checkpoint(path) else SafetensorsSource(path)
    else:
        from ckptctl.interop.torch_io import TorchSource

        src = TorchSource(path)
    src.step_clues.extend(steps.from_name(path))
    src.settle_step()
    return src
