"""Watches for host reads of tensors (``.item()``, ``.tolist()``, ``int()``, and the ops whose output size depends
on the data) made by DeepInfer's code: on a GPU each one stalls the host until the device has finished its
queue, so the engine adapters allow them only a fixed number of times per step and the grouped kernels' launchers
none. Used by the vLLM and SGLang adapter tests and the launcher tests; needs neither engine."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from torch.overrides import TorchFunctionMode

PACKAGE = Path(__import__("deepinfer_plugins").__file__).parent
HOST_READS = {"item", "tolist", "cpu", "numpy", "equal", "__bool__", "__int__", "__index__", "__float__", "nonzero",
              "bincount", "unique", "masked_select"}
TOKEN_CHECK = ("models/deepseek_v41/model.py", "check_tokens")


class HostReadWatch(TorchFunctionMode):
    """Counts host reads of tensors by the package function that made them (path relative to the package, function
    name); the op kernels' own are skipped (on a GPU they run the device backends, not these references)."""

    def __init__(self):
        super().__init__()
        self.sites: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            frame = sys._getframe(1)
            while frame and not frame.f_code.co_filename.startswith(str(PACKAGE)):
                frame = frame.f_back
            if frame is not None:
                where = Path(frame.f_code.co_filename).relative_to(PACKAGE).as_posix()
                if not where.startswith("ops/"):
                    self.sites[(where, frame.f_code.co_name)] += 1
        return func(*args, **(kwargs or {}))


class ModuleCalls(TorchFunctionMode):
    """Torch calls made directly by one module's code (not by what it calls, a Triton interpreter or a fake library
    underneath), and which of them read the device on the host."""

    def __init__(self, module):
        super().__init__()
        self.filename, self.calls, self.host_reads = module.__file__, 0, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if sys._getframe(1).f_code.co_filename == self.filename:
            self.calls += 1
            if getattr(func, "__name__", "") in HOST_READS:
                self.host_reads.append(func.__name__)
        return func(*args, **(kwargs or {}))
