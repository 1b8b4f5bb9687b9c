"""The recommendation as a line that runs after ``import torch, shardpack``: ``torch.utils.data.DataLoader(...)``.

Every value is a literal, a ``torch.``/``shardpack.`` expression, or a name from the user's own
code: torch's own samplers are written out as calls (``torch.utils.data.RandomSampler(dataset,
num_samples=3000)``, a ``BatchSampler`` of one); the user's functions, classes and objects by the
name their module binds them to (``collate_fn=stack_dicts``); anything else the user's loader
holds as ``loader.<attribute>`` of the loader bench measured. :func:`paste_line` returns the line
and the names it needs in scope, which the report prints under it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

TD = "torch.utils.data"


@dataclass
class Scope:
    """Where the user's names live: the modules searched for a global bound to an object, and
    the name of the user's DataLoader (``loader`` when it has none, e.g. a factory's result)."""

    modules: list = field(default_factory=list)
    loader_name: str | None = None
    made_by: str | None = None  # ``NAME()``: the no-argument factory (or class) that built the dataset or loader

    @classmethod
    def of(cls, target, obj, kind: str) -> Scope:
        """From the bench target (a ``FILE.py:NAME`` / ``module:NAME`` string or an object) and
        what it gave (``obj`` of ``kind`` "loader", "dataset" or "iterable")."""
        mods = []
        if isinstance(target, str) and ":" in target:
            where = target.rpartition(":")[0]
            stem = where.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".py")
            for name in (where, stem):
                if name in sys.modules:
                    mods.append(sys.modules[name])
        for thing in (target, obj, getattr(obj, "dataset", None)):
            mod = sys.modules.get(getattr(thing, "__module__", None) or type(thing).__module__)
            if mod is not None and mod not in mods and not mod.__name__.startswith(("torch", "builtins")):
                mods.append(mod)
        scope = cls(mods)
        maker = target
        if isinstance(target, str) and ":" in target and mods:
            maker = getattr(mods[0], target.rpartition(":")[2], None)
        if callable(maker) and maker is not obj and (name := scope.name_of(maker)) is not None:
            scope.made_by = f"{name}()"
        if kind == "loader":
            scope.loader_name = scope.name_of(obj)
        return scope

    def name_of(self, obj) -> str | None:
        """A global name bound to ``obj`` in the user's modules (a function or class by its own
        name when its module binds it; shardpack's own collate as ``shardpack.stack_collate``), or None."""
        from ...loading import stack_collate
        if obj is stack_collate:
            return "shardpack.stack_collate"
        qual = getattr(obj, "__qualname__", None)
        mod = sys.modules.get(getattr(obj, "__module__", "") or "")
        if qual and "." not in qual and "<" not in qual and mod is not None and getattr(mod, qual, None) is obj:
            if mod in self.modules or not mod.__name__.startswith(("torch", "shardpack")):
                return qual
        for m in self.modules:
            for name, value in vars(m).items():
                if value is obj and not name.startswith("_"):
                    return name
        return None


def _length_expr(source, dataset, ds_name: str) -> str:
    """``dataset`` when ``source`` has the dataset's length (a sampler only uses ``len``), else ``range(n)``."""
    try:
        n = len(source)
    except TypeError:
        return None
    try:
        same = source is dataset or n == len(dataset)
    except TypeError:
        same = False
    return ds_name if same else f"range({n})"


def sampler_expr(sampler, dataset, ds_name: str) -> str | None:
    """torch's own samplers as a call that rebuilds them (None for other kinds, or a generator
    that cannot be written): SequentialSampler, RandomSampler (replacement, num_samples),
    BatchSampler of one of those."""
    t = type(sampler)
    if t is SequentialSampler:
        src = _length_expr(sampler.data_source, dataset, ds_name)
        return None if src is None else f"{TD}.SequentialSampler({src})"
    if t is RandomSampler:
        if sampler.generator is not None:
            return None
        src = _length_expr(sampler.data_source, dataset, ds_name)
        if src is None:
            return None
        args = [src]
        if sampler.replacement:
            args.append("replacement=True")
        if sampler._num_samples is not None:
            args.append(f"num_samples={sampler._num_samples}")
        return f"{TD}.RandomSampler({', '.join(args)})"
    if t is BatchSampler:
        inner = sampler_expr(sampler.sampler, dataset, ds_name)
        return None if inner is None else f"{TD}.BatchSampler({inner}, {sampler.batch_size}, {sampler.drop_last})"
    return None


def plain_shuffle(sampler) -> bool:
    """True for what ``shuffle=True`` builds: a RandomSampler without replacement over the whole dataset."""
    return type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None


def paste_line(res) -> tuple[str, list[str]]:
    """``(line, needs)``: the recommendation as one ``torch.utils.data.DataLoader(...)`` call
    (the dataset first, the user's sampler, batch_sampler, collate_fn, drop_last, worker_init_fn,
    generator and multiprocessing context kept) and the user's names it uses, e.g.
    ``["train_set (your Dataset)", "stack_dicts"]``."""
    s, base = res.rec.setting, res.base
    scope = res.scope or Scope()
    needs: list[str] = []

    def named(obj, attr: str, what: str) -> str:
        name = scope.name_of(obj)
        if name is not None:
            needs.append(name)
            return name
        loader = scope.loader_name or "loader"
        needs.append(f"{loader} (your DataLoader)")
        return f"{loader}.{attr}"

    ds_name = scope.name_of(base.dataset)
    if ds_name is None and scope.made_by is not None and base.given is None:
        ds_name = scope.made_by  # e.g. train_set(): the factory that gave the Dataset
        needs.append(f"{ds_name[:-2]} (it builds your Dataset)")
    elif ds_name is None and scope.loader_name is not None:
        ds_name = f"{scope.loader_name}.dataset"
        needs.append(f"{scope.loader_name} (your DataLoader)")
    elif ds_name is None:
        ds_name = "dataset"
        needs.append("dataset (your Dataset)")
    else:
        needs.append(f"{ds_name} (your Dataset)")
    parts = [ds_name]
    if base.batch_sampler is not None:
        parts.append("batch_sampler=" + (sampler_expr(base.batch_sampler, base.dataset, ds_name)
                                         or named(base.batch_sampler, "batch_sampler", "batch sampler")))
    else:
        parts.append(f"batch_size={base.batch_size}")
        if base.sampler is not None and plain_shuffle(base.sampler):
            parts.append("shuffle=True")
        elif base.sampler is not None and type(base.sampler) is not SequentialSampler:
            parts.append("sampler=" + (sampler_expr(base.sampler, base.dataset, ds_name)
                                       or named(base.sampler, "sampler", "sampler")))
    parts.append(f"num_workers={s.workers}")
    if s.workers:
        parts += [f"prefetch_factor={s.prefetch}", f"persistent_workers={bool(s.persistent)}"]
    parts.append(f"pin_memory={s.pin}")
    fixed = base.fixed
    if fixed.get("drop_last") and base.batch_sampler is None:
        parts.append("drop_last=True")
    if use_stack(res):
        parts.append("collate_fn=shardpack.stack_collate")
    elif fixed.get("collate_fn") is not None:
        parts.append("collate_fn=" + named(fixed["collate_fn"], "collate_fn", "collate_fn"))
    if fixed.get("worker_init_fn") is not None:
        parts.append("worker_init_fn=" + named(fixed["worker_init_fn"], "worker_init_fn", "worker_init_fn"))
    if fixed.get("generator") is not None:
        parts.append("generator=" + named(fixed["generator"], "generator", "generator"))
    ctx = fixed.get("multiprocessing_context")
    if ctx is not None and s.workers:
        method = ctx if isinstance(ctx, str) else getattr(ctx, "get_start_method", lambda: None)()
        parts.append(f"multiprocessing_context={method!r}" if method else
                     "multiprocessing_context=" + named(ctx, "multiprocessing_context", "context"))
    if fixed.get("timeout"):
        parts.append(f"timeout={fixed['timeout']!r}")
    if fixed.get("in_order") is False:
        parts.append("in_order=False")
    return f"{TD}.DataLoader(" + ", ".join(parts) + ")", list(dict.fromkeys(needs))


def use_stack(res) -> bool:
    """True when the stack-only collate measured faster than the user's, beyond the spread."""
    return any(f["variant"] == "stack" and f["resolved"] and f["fixed_ms"] < f["yours_ms"] for f in res.fixes)
