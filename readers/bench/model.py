"""The model side of ``shardpack bench``: a training step timed alone on one fixed batch.

The data time is compared with it (``--model tiny`` or ``--model torchvision:NAME``); the user's
own model on a real batch of their loader is timed by ``user/step.py`` with the same loop.
"""

from __future__ import annotations

import statistics
import time

import torch

from .grid import Grid


def tiny_cnn(classes: int) -> torch.nn.Module:
    """A small CNN (two strided 3x3 convolutions, global pooling, a linear layer) taking float
    (B, 3, H, W) images of any size and giving (B, ``classes``) logits."""
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))


def model_step_ms(model: torch.nn.Module, shape, classes: int, device=None, seconds: float = 3.0,
                  warmup: int = 3, max_steps: int = 50) -> list[float]:
    """Milliseconds of each training step (forward, cross-entropy, backward, SGD step) of
    ``model`` on one fixed random float batch of ``shape`` (B, 3, H, W), channels_last, with
    random labels in ``range(classes)``, on ``device`` (default: CUDA when present, else the
    CPU). After ``warmup`` untimed steps, steps run until ``seconds`` have passed (at least 3,
    at most ``max_steps``); CUDA is synchronised after each. Returns the step times; take the
    median."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = model.to(dev).to(memory_format=torch.channels_last)
    x = torch.randn(shape, device=dev).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, classes, (shape[0],), device=dev)
    return timed_steps(model, x, y, dev, lambda t: t, warmup, seconds, max_steps)


def timed_steps(model, x, y, dev, prep, warmup: int, seconds: float, max_steps: int) -> list[float]:
    """Milliseconds of each SGD training step of ``model`` on the fixed batch ``(prep(x), y)``:
    ``warmup`` untimed steps, then steps until ``seconds`` have passed (at least 3, at most
    ``max_steps``), CUDA synchronised after each. A model without trainable parameters (nothing
    for an optimizer) runs forward and the loss only, under ``torch.no_grad`` (see
    :func:`trainable`)."""
    train = trainable(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if train else None
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        t0 = time.perf_counter()
        if opt is None:
            with torch.no_grad():
                loss_fn(model(prep(x)), y)
        else:
            loss = loss_fn(model(prep(x)), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return 1000 * (time.perf_counter() - t0)

    for _ in range(warmup):
        step()
    times, end = [], time.perf_counter() + seconds
    while len(times) < 3 or (time.perf_counter() < end and len(times) < max_steps):
        times.append(step())
    return times


def trainable(model: torch.nn.Module) -> bool:
    """True when ``model`` has a parameter that requires grad (what an optimizer steps)."""
    return any(p.requires_grad for p in model.parameters())


def build_model(spec: str, classes: int) -> torch.nn.Module:
    """``--model`` -> module: ``tiny`` (:func:`tiny_cnn`) or ``torchvision:NAME`` (any
    torchvision.models constructor, when torchvision imports). Raises ValueError otherwise."""
    if spec == "tiny":
        return tiny_cnn(classes)
    if spec.startswith("torchvision:"):
        try:
            import torchvision
        except Exception as err:  # noqa: BLE001 -- not installed, or a build that does not load beside this torch
            raise ValueError(f"--model {spec}: torchvision does not import here ({err})") from None
        ctor = getattr(torchvision.models, spec.split(":", 1)[1], None)
        if ctor is None:
            raise ValueError(f"--model {spec}: torchvision.models has no such model")
        return ctor(num_classes=classes)
    raise ValueError(f"--model {spec!r}: use tiny or torchvision:NAME (e.g. torchvision:resnet18), or "
                     f"FILE.py:NAME / module:NAME naming your own")


def measure_step(spec: str, grid: Grid, classes: int, device=None, module=None) -> dict:
    """Time ``spec``'s training step (``module`` when already built) on a fixed batch shaped
    like ``grid``'s. Returns {"model", "device", "ms" (median), "steps_ms"}. Raises ValueError,
    one line naming the batch, the classes and the error, when the step itself raises (a model
    whose output does not match the output's classes, or its input shape)."""
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    module = module if module is not None else build_model(spec, classes)
    shape = (grid.batch_size, *grid.shape)
    try:
        times = model_step_ms(module, shape, classes, dev)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:  # noqa: BLE001 -- the user's model: one line, not a traceback
        first = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        raise ValueError(f"--model {spec}: the training step raised {first}; it runs on inputs {shape} float32 "
                         f"and labels ({shape[0]},) int64 in [0, {classes}): a model for this output takes such a "
                         f"batch and returns ({shape[0]}, {classes}) logits") from None
    return {"model": spec, "device": str(dev), "ms": statistics.median(times), "steps_ms": times}
