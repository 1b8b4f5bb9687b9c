"""The user's model timed on one real batch of their own loader, fed as it yields it (or as built-ins take it)."""

from __future__ import annotations

import statistics

import torch

from ..model import timed_steps, trainable
from .target import TargetError


def fixed_batch_step(model: torch.nn.Module, batch, device=None, how: str = "as-is", seconds: float = 3.0,
                     warmup: int = 3, max_steps: int = 50) -> dict:
    """Time ``model``'s training step on one real ``batch`` from the user's loader, replayed:
    forward on ``batch[0]``, cross-entropy against ``batch[1]``, backward, an SGD step, CUDA
    synchronised after each. ``how``: "as-is" feeds the batch exactly as the loader yields it
    (the user's model); "builtin" (tiny, torchvision) makes it float CHW first, /255 for
    integers, inside the timed step. Steps as ``model_step_ms`` times them (forward only, said in
    ``how``, for a model without trainable parameters). Returns {"device",
    "ms" (median), "steps_ms", "how"}. Raises TargetError (one line) when the step fails."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if not isinstance(batch, (list, tuple)) or len(batch) < 2:
        raise TargetError("--model: the step needs (inputs, labels) batches; the loader yields "
                          f"a {type(batch).__name__}")
    x, y = batch[0], batch[1]
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise TargetError(f"--model: batch[0] and batch[1] must be tensors, got {type(x).__name__} and "
                          f"{type(y).__name__}")
    x, y = x.to(dev), y.to(dev)
    model = model.to(dev)
    prep, note = input_prep(x, how)
    try:
        times = timed_steps(model, x, y, dev, prep, warmup, seconds, max_steps)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:
        first = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        raise TargetError(f"--model: the training step on your batch (inputs {tuple(x.shape)} {x.dtype}, "
                          f"labels {tuple(y.shape)} {y.dtype}) raised {first}") from err
    if not trainable(model):
        note += ("; forward only: the model has no trainable parameters (no backward or optimizer step "
                 "to time)")
    return {"device": str(dev), "ms": statistics.median(times), "steps_ms": times, "how": note}


def input_prep(x: torch.Tensor, how: str):
    """``(prep, note)``: what the step does to the loader's input before the forward. "as-is":
    nothing; "builtin": float CHW (permuted from HWC, /255 from integers) for tiny/torchvision."""
    if how != "builtin":
        return (lambda t: t), "the batch as the loader yields it"
    hwc = x.ndim == 4 and x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3)
    note = ("float CHW for the built-in model" + (" (permuted from HWC)" if hwc else "")
            + (", /255 from integers" if not x.is_floating_point() else ""))

    def prep(t):
        t = t.permute(0, 3, 1, 2) if hwc else t
        return t.float().div(255) if not t.is_floating_point() else t
    return prep, note
