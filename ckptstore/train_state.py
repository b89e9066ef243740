"""TrainState: everything a run needs to resume exactly, as one object the store saves and restores.

A resume that replays or skips samples, or draws different random numbers, silently changes the
run. TrainState gathers model, optimizer, LR scheduler, GradScaler, data-loader position, user
extras and every RNG state into one state dict, and restores them in an order that keeps the run
bitwise on course: the RNG states last, so nothing done while restoring consumes random numbers.

Model and optimizer go through ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict``
and friends): optimizer state keyed by parameter names rather than ids, and FSDP2 / DTensor models
handled the same way as plain ones. Model tensors load in place; the optimizer's state is loaded
into the tensors those helpers initialise.
"""

from __future__ import annotations

import operator
import random
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .checkpoint.sharded import PerRank
from .errors import CheckpointError, InvalidArgumentError
from .planning.flatten import dtensor_internals

_VERSION = 1
# Model parts (pipeline stages): optimizer state keyed flat by parameter name, as torchtitan keeps it,
# so the stages' parts of the state never collide (nested param_groups lists would differ per stage).
_VERSION_PARTS = 2


class TrainState:
    """The parts of a training run that a checkpoint must bring back.

    ``loader``: any object with ``state_dict``/``load_state_dict`` (torchdata's StatefulDataLoader,
    :class:`ckptstore.data.ResumableLoader`). Its state is stored per rank unless the loader says
    its state is global (``ckptstore_global_state = True``, as ResumableLoader does: one global
    sample cursor, valid at any world size).

    ``generators``: named RNGs the run draws from besides the global ones (``torch.Generator`` or
    ``numpy.random.Generator``); the global python, numpy, torch CPU and CUDA states are always
    saved, per rank.

    ``model`` may be a list of model parts (a pipeline rank's stages, as torchtitan's model wrapper
    holds them; parameter names unique across parts) with ``optimizer`` a list of one optimizer per
    part (or one optimizer over all of them). Then every part's model and optimizer state goes into
    one flat dict of parameter-name keys, so ranks of other stages add their own keys to the
    checkpoint and a load into any other split finds each parameter by name.

    After a restore, ``extra`` holds the saved extras.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        loader: Any = None,
        extra: Mapping[str, Any] | None = None,
        generators: Mapping[str, Any] | None = None,
    ) -> None:
        if optimizer is not None and model is None:
            raise InvalidArgumentError("TrainState(optimizer=...) needs model= too: optimizer state is keyed by parameter names")
        for name, obj in (("scheduler", scheduler), ("scaler", scaler), ("loader", loader)):
            if obj is not None and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise InvalidArgumentError(f"TrainState({name}=...) needs an object with state_dict() and load_state_dict()")
        self.parts: list[torch.nn.Module] | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        if isinstance(model, (list, tuple)):
            self.parts = list(model)
            if not self.parts or not all(isinstance(m, torch.nn.Module) for m in self.parts):
                raise InvalidArgumentError("TrainState(model=[...]) takes a non-empty list of torch.nn.Module parts")
            opts: list[Any] = list(optimizer) if isinstance(optimizer, (list, tuple)) else [] if optimizer is None else [optimizer]
            if len(opts) not in (0, len(self.parts)):
                # One optimizer over several parts would key its state by its position in a wrapper,
                # which another split of the stages does not reproduce (torchtitan keeps one per part).
                raise InvalidArgumentError(
                    f"TrainState got {len(self.parts)} model parts and {len(opts)} optimizers: give one optimizer per part"
                )
            self.optimizers = opts
        elif isinstance(optimizer, (list, tuple)):
            raise InvalidArgumentError("TrainState(optimizer=[...]) needs model=[...] parts, one per optimizer")
        # A single module (and its optimizer) when parts is None; the parts are in self.parts.
        self.model: Any = model
        self.optimizer: Any = optimizer
        self.scheduler, self.scaler, self.loader = scheduler, scaler, loader
        self.extra: dict[str, Any] = dict(extra or {})
        self.generators: dict[str, Any] = dict(generators or {})
        self._fast = StateDicts()

    # ------------------------------------------------------------------------------ saving

    def state_dict(self) -> dict[str, Any]:
        """The state to save: plain values, tensors (DTensors for sharded models) and PerRank values.

        The model's and the optimizer's parts equal what torch's ``get_model_state_dict`` and
        ``get_optimizer_state_dict`` return; while the model's structure holds they are built
        without them (see :class:`StateDicts`), which a save of many tensors would mostly pay for."""
        if self.parts is not None:
            sd: dict[str, Any] = {"version": _VERSION_PARTS, **self._parts_state()}
        else:
            sd = {"version": _VERSION}
        if self.model is not None and self.parts is None:
            sd["model"] = self._fast.model(self.model)
        if self.optimizer is not None and self.parts is None:
            sd["optimizer"] = self._fast.optimizer(self.model, self.optimizer)
        if self.scheduler is not None:
            sd["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            sd["scaler"] = self.scaler.state_dict()
        if self.loader is not None:
            state = self.loader.state_dict()
            sd["loader"] = state if _global(self.loader) else PerRank(state)
        sd["extra"] = dict(self.extra)
        sd["rng"] = PerRank(capture_rng(self.generators))
        return sd

    # ------------------------------------------------------------------------------ restoring

    def skeleton(self) -> dict[str, Any]:
        """What a load fills: model and optimizer tensors in place, everything else replaced."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        sd: dict[str, Any] = {"version": None}
        if self.parts is not None:
            sd.update(self._parts_state())  # initialises fresh optimizers' state, as below
        elif self.model is not None:
            sd["model"] = get_model_state_dict(self.model)
        if self.optimizer is not None and self.parts is None:
            # Initialises a fresh optimizer's state (with a zero learning rate), so sharded state
            # has shards to load into.
            sd["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)  # type: ignore[arg-type]
        for name in ("scheduler", "scaler"):
            if getattr(self, name) is not None:
                sd[name] = None
        if self.loader is not None:
            sd["loader"] = None if _global(self.loader) else PerRank(None)
        sd["extra"] = None
        sd["rng"] = PerRank(None)
        return sd

    def load_skeleton(self, sd: dict[str, Any]) -> None:
        """Apply a filled :meth:`skeleton` to the live objects; the RNG states last."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        want = _VERSION if self.parts is None else _VERSION_PARTS
        if sd.get("version") != want:
            raise CheckpointError(
                f"TrainState version {sd.get('version')!r} is not {want}: "
                + ("this checkpoint holds model parts; restore it with TrainState(model=[...parts])" if sd.get("version") == _VERSION_PARTS
                   else "this TrainState has model parts (model=[...]) but the checkpoint holds one model; pass model= the module"
                   if want == _VERSION_PARTS else "use a matching ckptstore")
            )
        if self.parts is not None:
            self._load_parts(sd)
        elif self.optimizer is not None:
            set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])  # type: ignore[arg-type]
        elif self.model is not None:
            set_model_state_dict(self.model, sd["model"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(sd["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(sd["scaler"])
        if self.loader is not None:
            value = sd["loader"]
            if isinstance(value, PerRank):
                value = value.value
            if value is not None:  # None: a per-rank position skipped at another world size
                self.loader.load_state_dict(value)
        self.extra = dict(sd["extra"] or {})
        rng = sd["rng"].value if isinstance(sd["rng"], PerRank) else None
        if rng is not None:
            restore_rng(rng, self.generators)

    def all_optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer this state holds (one per model part, or the one)."""
        if self.parts is not None:
            return list(self.optimizers)
        return [] if self.optimizer is None else [self.optimizer]  # type: ignore[list-item]

    def _pairs(self) -> list[tuple[torch.nn.Module, torch.optim.Optimizer | None]]:
        assert self.parts is not None
        if self.optimizers:
            return list(zip(self.parts, self.optimizers))
        return [(m, None) for m in self.parts]

    def _parts_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        out: dict[str, Any] = {"model": {}}
        assert self.parts is not None
        for part, opt in self._pairs():
            out["model"].update(get_model_state_dict(part))
            if opt is not None:
                out.setdefault("optimizer", {}).update(get_optimizer_state_dict(part, opt, options=flat))
        return out

    def _load_parts(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        # Each part takes its own keys from the one flat dict; the others' are not its business.
        options = StateDictOptions(strict=False, flatten_optimizer_state_dict=True)
        assert self.parts is not None
        for part, opt in self._pairs():
            set_model_state_dict(part, sd["model"], options=options)
            if opt is not None:
                set_optimizer_state_dict(part, opt, sd["optimizer"], options=options)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore from a complete state dict (as returned by :meth:`state_dict` or loaded whole)."""
        self.load_skeleton(sd)


class StateDicts:
    """Torch's ``get_model_state_dict(model)`` and ``get_optimizer_state_dict(model, optimizer)``
    of one model, built without them while its structure holds.

    Torch's functions cost about 80 us per parameter at every call (option checks, the FQN map of
    every parameter, a DTensor ``detach`` through DTensor's dispatch), which at 10,000 parameters
    is ten times what copying their bytes costs. For a module whose state dict is
    ``Module.state_dict``'s own (no module overrides it or its parts, and none has a post-hook;
    pre-hooks, such as FSDP2's, run as there), this replays ``Module.state_dict``: the same keys,
    order and ``_metadata``, each parameter and persistent buffer detached. A DTensor's detached
    alias is kept while the DTensor keeps its local tensor and spec objects and the alias still
    views that tensor as it is (a ``.data`` or ``set_`` on it shows); other tensors are detached
    afresh. The optimizer's part is rebuilt at every call from ``optimizer.state`` and
    ``param_groups`` with a map from parameters to names, so new state and new groups show at once.

    Torch's own functions decide whenever the replay's keys differ from those last checked (the
    first call, a parameter added, removed or renamed): their output is compared with the
    replay's, and a model where they differ (wrappers whose keys torch renames: DDP,
    ``torch.compile``, FSDP1) keeps torch's functions. So does an optimizer without state (torch
    initialises it), one with state-dict hooks or its own ``state_dict``, and one holding a
    parameter the map does not name.
    """

    def __init__(self) -> None:
        self._keys: list[str] | None = None  # the model's keys, as torch's own output last confirmed
        self._torch_only: list[str] | None = None  # keys whose replay torch's output contradicted
        # key -> (the DTensor, its local tensor and spec, its detached alias, the alias's local tensor)
        self._aliases: dict[str, tuple[Any, torch.Tensor, Any, Any, torch.Tensor]] = {}
        self._names: dict[int, str] | None = None  # id(parameter) -> name, for the optimizer's part
        self._held: list[torch.Tensor] = []  # the parameters of _names: their ids stay theirs
        # The model's parameters in replay order, of the last replay and of the one _names was made at.
        self._params: list[torch.Tensor] = []
        self._named_params: list[torch.Tensor] | None = None
        self._types: dict[type, bool] = {}

    def model(self, model: torch.nn.Module) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        mine = self._replay(model)
        if mine is None:
            return get_model_state_dict(model)
        keys = list(mine)
        if keys == self._keys:
            if self._named_params is not None and not _same_objects(self._params, self._named_params):
                # A parameter replaced under its name: torch's own functions name the optimizer's
                # parameters afresh (and refuse one the model no longer holds).
                self._names = self._named_params = None
            return mine
        ref = get_model_state_dict(model)
        if keys != self._torch_only and same_state_dict(mine, ref):
            self._keys, self._names = keys, None
            return mine
        self._keys, self._torch_only, self._aliases = None, keys, {}
        return ref

    def optimizer(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        names = self._names
        if names is not None and self._keys is not None and _plain_optimizer(optimizer):
            mine = _optimizer_state(optimizer, names)
            if mine is not None:
                return mine
        ref = get_optimizer_state_dict(model, optimizer)
        self._names = None
        if self._keys is not None and _plain_optimizer(optimizer):
            # Torch names a tied parameter by its first name in named_parameters().
            params = dict(model.named_parameters())
            names = {id(p): name for name, p in params.items()}
            mine = _optimizer_state(optimizer, names)
            if mine is not None and same_state_dict(mine, ref):
                self._names, self._held, self._named_params = names, list(params.values()), self._params
        return ref

    def _replay(self, model: torch.nn.Module) -> dict[str, Any] | None:
        """``model.state_dict()`` replayed (see the class docstring); None where it cannot be."""
        from collections import OrderedDict

        from torch.distributed.tensor import DTensor

        dest: Any = OrderedDict()
        meta: Any = OrderedDict()
        dest._metadata = meta
        old = self._aliases
        new: dict[str, Any] = {}
        seen: list[torch.Tensor] = []
        types = self._types
        stack = [(model, "")]
        # Module.state_dict's order: a module's parameters, its persistent buffers, then each child
        # in turn (a depth-first walk; a module reached twice is walked twice, as there).
        while stack:
            module, prefix = stack.pop()
            kind = type(module)
            ok = types.get(kind)
            if ok is None:
                ok = types[kind] = _replayable(kind)
            # An instance may carry its own state_dict (torch's _patch_model_state_dict sets one).
            if not ok or module._state_dict_hooks or "state_dict" in module.__dict__ or "_save_to_state_dict" in module.__dict__:
                return None
            meta[prefix[:-1]] = {"version": module._version}
            for hook in module._state_dict_pre_hooks.values():
                hook(module, prefix, False)
            tensors: list[tuple[str, torch.Tensor]] = [(n, t) for n, t in module._parameters.items() if t is not None]
            seen.extend(t for _, t in tensors)
            skip = module._non_persistent_buffers_set
            tensors += [(n, t) for n, t in module._buffers.items() if t is not None and n not in skip]
            for name, t in tensors:
                key = prefix + name
                if type(t) is DTensor:
                    dest[key] = _alias(key, t, old, new)
                else:
                    dest[key] = t.detach()
            children = [(c, f"{prefix}{name}.") for name, c in module._modules.items() if c is not None]
            stack.extend(reversed(children))
        self._aliases, self._params = new, seen
        return dest


def _alias(key: str, t: Any, old: dict[str, Any], new: dict[str, Any]) -> Any:
    """``t.detach()`` of a DTensor, the one of the last call while it still is that."""
    found = dtensor_internals(t)
    if found is None:
        return t.detach()
    local, spec = found
    held = old.get(key)
    if held is not None and held[0] is t and held[1] is local and held[2] is spec:
        view = held[4]
        # What a .data, set_, resize_ or as_strided_ on the local tensor changes (a device
        # change moves the data too); dtypes are singletons.
        if (view.data_ptr() == local.data_ptr() and view.dtype is local.dtype and view.stride() == local.stride()
                and view.shape == local.shape):
            new[key] = held
            return held[3]
    alias = t.detach()
    parts = dtensor_internals(alias)
    if parts is not None:
        new[key] = (t, local, spec, alias, parts[0])
    return alias


def _same_objects(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _replayable(kind: Any) -> bool:
    """Whether modules of ``kind`` fill their state dict as ``Module.state_dict`` does itself."""
    base: Any = torch.nn.Module
    return (kind.state_dict is base.state_dict and kind._save_to_state_dict is base._save_to_state_dict
            and getattr(kind, "get_extra_state", base.get_extra_state) is base.get_extra_state)


def _plain_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    base = torch.optim.Optimizer
    return (bool(optimizer.state) and type(optimizer).state_dict is base.state_dict
            and not optimizer._optimizer_state_dict_pre_hooks and not optimizer._optimizer_state_dict_post_hooks)


def _optimizer_state(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any] | None:
    """What ``get_optimizer_state_dict`` returns for a plain optimizer (``Optimizer.state_dict``
    with parameter names for its indices); None when a parameter is not in ``names``."""
    try:
        state = {names[id(p)]: v for p, v in optimizer.state.items()}
        groups = []
        for group in optimizer.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [names[id(p)] for p in group["params"]]
            groups.append(packed)
    except KeyError:
        return None
    return {"state": state, "param_groups": groups}


def same_state_dict(a: Any, b: Any) -> bool:
    """Whether two state dicts are the same to a save: the same containers with the same keys in
    the same order (and ``_metadata``), equal values, and tensors of the same type, dtype, shape,
    strides, device, ``requires_grad`` and storage (DTensors: the same spec, and local tensors so)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        found_a, found_b = dtensor_internals(a), dtensor_internals(b)
        if (found_a is None) != (found_b is None):
            return False
        if found_a is not None and found_b is not None:
            if found_a[1] != found_b[1]:
                return False
            a, b = found_a[0], found_b[0]
            if type(a) is not type(b):
                return False
        return bool(a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and a.device == b.device
                    and a.requires_grad == b.requires_grad and a.data_ptr() == b.data_ptr()
                    and a.storage_offset() == b.storage_offset())
    if isinstance(a, dict):
        if list(a) != list(b) or getattr(a, "_metadata", None) != getattr(b, "_metadata", None):
            return False
        return all(same_state_dict(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state_dict(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values without one truth value (arrays): torch's output decides
        return False


def _global(loader: Any) -> bool:
    return bool(getattr(loader, "ckptstore_global_state", False))


def capture_rng(generators: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every RNG state of this process: python, numpy's legacy global state, torch CPU, each CUDA
    device (only once CUDA is initialised: touching it would create contexts), and ``generators``."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # numpy is optional
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    named = {}
    for name, gen in (generators or {}).items():
        if isinstance(gen, torch.Generator):
            named[name] = {"torch": gen.get_state()}
        elif hasattr(gen, "bit_generator"):
            named[name] = {"numpy": gen.bit_generator.state}
        else:
            raise InvalidArgumentError(f"generator {name!r} is a {type(gen).__name__}: use torch.Generator or numpy.random.Generator")
    state["generators"] = named
    return state


def restore_rng(state: Mapping[str, Any], generators: Mapping[str, Any] | None = None) -> None:
    """Put back what :func:`capture_rng` took. A generator saved but not registered now (or the
    reverse) is an error: resuming with it unset would silently change the run."""
    random.setstate(_tuples(state["python"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if len(saved) != torch.cuda.device_count():
            raise CheckpointError(
                f"the checkpoint holds RNG states of {len(saved)} CUDA devices but this process sees "
                f"{torch.cuda.device_count()}; resume with the same devices per rank"
            )
        torch.cuda.set_rng_state_all(saved)
    named = dict(state.get("generators", {}))
    mine = dict(generators or {})
    if set(named) != set(mine):
        raise CheckpointError(
            f"the checkpoint has RNG generators {sorted(named)} but this TrainState registers {sorted(mine)}; "
            "register the same generators= to resume exactly"
        )
    for name, gen in mine.items():
        saved_state = named[name]
        if "torch" in saved_state:
            gen.set_state(saved_state["torch"])
        else:
            gen.bit_generator.state = saved_state["numpy"]


def _tuples(value: Any) -> Any:
    """random.setstate wants tuples all the way down."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, tuple):
        return tuple(_tuples(v) for v in value)
    return value
