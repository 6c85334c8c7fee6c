"""One device-to-host copy for everything a step's host code reads."""

from __future__ import annotations

import torch


class HostTransfer:
    """Collects device tensors, then copies them to the host in one transfer.

    Every tensor is flattened into one fp32 buffer: floating tensors are cast to fp32, integer and
    bool ones to int32 and bit-viewed as fp32 (so ids up to 2**31 - 1 travel exactly). On CUDA the
    buffer is copied ``non_blocking`` into pinned memory followed by one stream synchronize;
    elsewhere with ``.to("cpu")``. Each :meth:`add` returns a slot; :meth:`fetch` returns the host
    tensors by slot, with their shapes, as fp32 or int32.
    """

    def __init__(self):
        self._parts: list[torch.Tensor] = []
        self._layout: list[tuple[torch.Size, bool]] = []  # shape, is integer

    def add(self, tensor: torch.Tensor) -> int:
        is_int = not tensor.is_floating_point()
        flat = tensor.reshape(-1)
        flat = flat.to(torch.int32).view(torch.float32) if is_int else flat.to(torch.float32)
        self._parts.append(flat)
        self._layout.append((tensor.shape, is_int))
        return len(self._parts) - 1

    def fetch(self) -> list[torch.Tensor]:
        """Copy once and split; raises nothing beyond what the copy itself raises."""
        if not self._parts:
            return []
        buf = torch.cat(self._parts) if len(self._parts) > 1 else self._parts[0]
        if buf.device.type == "cuda":
            host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
            host.copy_(buf, non_blocking=True)
            torch.cuda.current_stream(buf.device).synchronize()
        else:
            host = buf.to("cpu")
        out, offset = [], 0
        for shape, is_int in self._layout:
            n = shape.numel()
            part = host[offset:offset + n]
            out.append((part.view(torch.int32) if is_int else part).reshape(shape))
            offset += n
        return out


def to_device(data, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` on ``device``. On CUDA it goes through pinned memory with
    ``non_blocking``: a blocking host-to-device copy synchronizes the stream, so it would wait for
    the kernels already queued (the forward pass)."""
    host = torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
