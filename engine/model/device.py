"""Host values onto the model's device: on CUDA through pinned memory, without blocking (the copy queues behind the
step's kernels instead of waiting for them); elsewhere a plain tensor."""
import torch


def to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
