"""A probe of the largest tensor the operations run under it return (the memory tests of sparse cores)."""

from __future__ import annotations

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LargestOutput(TorchDispatchMode):
    """Records, over every operation run under it (forward and backward): ``numel``, the largest tensor returned;
    ``elements``, the largest storage returned (in elements: an expanded view counts once; meta tensors, which own
    no memory, are passed over); ``ops``, the names of the operations."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0
        self.elements = 0
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(func.overloadpacket.__name__)
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self.numel = max(self.numel, t.numel())
                if t.device.type != "meta":
                    self.elements = max(self.elements, t.untyped_storage().nbytes() // t.element_size())
        return out
