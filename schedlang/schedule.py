"""The ``Schedule``: a tree of views over a model, with one typed method per primitive.

A schedule never changes the user's model. ``create_schedule`` deep-copies it once (free
for a model on the meta device) and every primitive works on that copy. A ``Schedule``
object is a light view: the shared root state plus a dotted path, so ``sch["layers.0"]``
always shows the module that is at that path *now*, after replacements and tracing.

Each primitive call checks its arguments first, then changes the working copy; if the
change itself fails, the tree is restored, so nothing is ever half-applied. A successful
call is recorded as a :class:`~schedlang.plan.Step` of ``sch.plan``.

Every primitive is a real method here, a stub whose signature is checked against the
primitive's declaration when the class is defined (and by a test); the primitive's file
holds everything else (docs, checks, JSON form). Layers import downward: primitives, then
the plan, then this module, then :mod:`schedlang.replaying`, build and verify.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import inspect
import logging
import os
from collections.abc import MutableMapping
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.fx as fx
from torch import nn

from . import primitives  # noqa: F401  (registers every primitive before the methods below are checked)
from .distributed import groups
from .errors import ArgumentTypeError, ScheduleKeyError, ScheduleTypeError, ScheduleValueError
from .fingerprint import ModelFingerprint
from .graph.inlined import inlined_by_trace
from .plan import Plan, Step
from .primitives.base import get_primitive, signature_mismatch
from .schedule_queries import INTERNAL_CHILD as _INTERNAL_CHILD
from .schedule_queries import ScheduleQueries, list_names
from .schedule_queries import join_path as _join

__all__ = ["Schedule", "create_schedule"]

logger = logging.getLogger("schedlang.schedule")

#: primitives that act on a module's tensors or record, not through its forward: they apply also to a module a traced
#: ancestor inlined (its leaves' tensors are still its tensors)
_WITHOUT_FORWARD = ("shard", "annotate")



class _RootState:
    """What all views of one schedule share."""

    def __init__(self, module: nn.Module, original: nn.Module, group, mesh=None):
        self.module = module
        self.original = original
        self.group = group
        self.mesh = mesh
        self.plan = Plan(fingerprint=ModelFingerprint.of(original) if original is not None else None)
        #: per-path notes for the report (graphs as traced, horizontal fusion counts ...); what a primitive did
        #: to a module that later code relies on is in the module's record (schedlang.module_record)
        self.metadata: Dict[str, Dict[str, Any]] = {}
        #: set by ``build``: the model is now the one being trained, and its optimizer holds its parameters
        self.built = False
        self._group_shape: Optional[Tuple[int, int]] = None
        #: inside ``atomic(nested_undo=False)``: that block's undo covers everything and nothing inside catches a
        #: primitive's error, so the primitives take no snapshot of their own
        self.undo_taken_outside = False
        #: ``[(path, module)]`` of the whole model, walked once for the primitive now running (its checks and its
        #: apply, which run before it changes anything) and dropped when it returns; None outside a primitive
        self.walk_of_running: Optional[List[Tuple[str, nn.Module]]] = None
        self.primitives_running = 0  # how deep primitives run inside one another now

    def group_shape(self) -> Tuple[int, int]:
        """``(world_size, rank)`` of the schedule's group, asked of torch.distributed once: the group is fixed
        when the schedule is made, and asking costs a call into the process group (every ``shard`` asks)."""
        if self._group_shape is not None:
            return self._group_shape
        shape = (groups.world_size(self.group), groups.rank(self.group))
        if groups.is_distributed():  # before init_process_group the world is this process alone, for now
            self._group_shape = shape
        return shape


def _copy_container(value: Any) -> Any:
    if isinstance(value, dict):
        return type(value)(value) if type(value) is not dict else dict(value)
    if isinstance(value, list):
        return list(value)
    return value


def _copy_attributes(attributes: Dict[str, Any]) -> Dict[str, Any]:
    """A module's ``__dict__`` with its dicts and lists copied one level deep. Taken for every module at every
    primitive call (``shard_model`` on a 22-layer LLaMA makes about 250 calls over 300 modules), so the common
    case, a dict or list of the exact type, is one type test and one ``copy()``."""
    copied = attributes.copy()
    for key, value in attributes.items():
        kind = type(value)
        if kind is dict or kind is list or kind is collections.OrderedDict:
            copied[key] = value.copy()
        elif isinstance(value, (dict, list)):
            copied[key] = _copy_container(value)
    return copied


class ScheduleMetadata(MutableMapping):
    """A schedule's notes at one path (reads and writes go to the schedule's own dictionary), plus the
    attributes Slapo scripts read from ``sch.metadata``, computed from the model so they cannot go stale:

    * ``tie_weights``: every parameter held by more than one module of the whole model, mapped to itself
      (sharding keeps ties: every holder gets the same new parameter);
    * ``param_tags``: the annotation keys ``annotate`` set on this module's parameters;
    * ``primitives``: the notes themselves.
    """

    def __init__(self, notes: Dict[str, Any], sch: "Schedule"):
        self._notes, self._sch = notes, sch

    def __getitem__(self, key):
        return self._notes[key]

    def __setitem__(self, key, value):
        self._notes[key] = value

    def __delitem__(self, key):
        del self._notes[key]

    def __iter__(self):
        return iter(self._notes)

    def __len__(self):
        return len(self._notes)

    def __repr__(self):
        return f"ScheduleMetadata({self._notes!r})"

    @property
    def tie_weights(self) -> Dict[Any, Any]:
        holders: Dict[int, list] = {}
        for module in self._sch.root.mod.modules():
            for param in module._parameters.values():
                if param is not None:
                    holders.setdefault(id(param), []).append(param)
        return {found[0]: found[0] for found in holders.values() if len(found) > 1}

    @property
    def param_tags(self) -> set:
        from .module_record import module_record

        # every annotation under this schedule's module, as Slapo's one set per schedule tree
        return {key for module in self._sch.mod.modules() for tags in module_record(module).annotations.values()
                for key in tags}

    @property
    def primitives(self) -> Dict[str, Any]:
        return self._notes


class _Undo:
    """What it takes to put a schedule back as it was: every module's attribute dictionaries,
    the plan's length and the metadata.

    Primitives never change tensors or a module's class in place (they swap in new ``Parameter``
    objects, child modules, hooks and graphs; a module that needs another class is replaced by a
    new instance in its parent's child table), so restoring the dictionaries restores the tree.
    Beyond them it keeps the attributes set on parameters (``annotate``), a transformers config's
    attributes (``trace`` turns ``use_cache`` off) and a traced module's generated
    ``forward``, which FX stores on the module's own class.
    """

    def __init__(self, state: _RootState):
        self.state = state
        self.root = state.module
        self.plan_length = len(state.plan)
        self.metadata = {path: {k: _copy_container(v) for k, v in entry.items()}
                         for path, entry in state.metadata.items()}
        self.modules = []
        self.objects = []
        seen = set()
        for m in self.root.modules():
            d = _copy_attributes(m.__dict__)
            forward = vars(type(m)).get("forward") if isinstance(m, fx.GraphModule) else None
            self.modules.append((m, d, forward))
            extra = list(m._parameters.values())
            config = m.__dict__.get("config")
            if config is not None and hasattr(config, "to_dict"):
                extra.append(config)
            for obj in extra:
                if obj is not None and id(obj) not in seen:
                    seen.add(id(obj))
                    self.objects.append((obj, dict(obj.__dict__)))

    def restore(self) -> None:
        state = self.state
        state.module = self.root
        for m, d, forward in self.modules:
            m.__dict__.clear()
            m.__dict__.update(d)
            if forward is not None and vars(type(m)).get("forward") is not forward:
                type(m).forward = forward
        for obj, d in self.objects:
            obj.__dict__.clear()
            obj.__dict__.update(d)
        state.plan._truncate(self.plan_length)
        state.metadata.clear()
        state.metadata.update(self.metadata)


def _call_form(sig: inspect.Signature) -> str:
    """A method's arguments as a user writes them, without ``self`` and annotations: ``tensor_name, axis``."""
    shown = []
    for p in list(sig.parameters.values())[1:]:
        if p.kind is p.VAR_POSITIONAL:
            shown.append(f"*{p.name}")
        elif p.kind is p.VAR_KEYWORD:
            shown.append(f"**{p.name}")
        else:
            shown.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(shown)


def _primitive_method(fn: Callable) -> Callable:
    """Make ``fn`` (a stub named after a registered primitive) the ``Schedule`` method that calls it.

    The stub's signature must be the one the primitive declares (checked here, when the class
    is defined); the docstring is the primitive's.
    """
    primitive = get_primitive(fn.__name__)
    problem = signature_mismatch(fn, primitive)
    if problem:
        raise TypeError(f"Schedule.{fn.__name__} does not match its primitive's declaration: {problem}")
    sig = inspect.signature(fn)
    var_keyword = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    if var_keyword is not None and any(p.variadic == "**" for p in primitive.params):
        var_keyword = None  # a declared **argument: passed on as one dict, not as options

    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        try:
            bound = sig.bind(self, *args, **kwargs)
        except TypeError as e:
            # Python's own wording ("missing a required argument: 'axis'") names neither the schedule path
            # nor the call that would work; say both, before anything is looked at or changed
            raise ArgumentTypeError(f"{self._display()}: {fn.__name__} got the wrong arguments ({e}); call it as "
                                    f"{fn.__name__}({_call_form(sig)})") from None
        bound.apply_defaults()
        call = dict(bound.arguments)
        del call["self"]
        options = call.pop(var_keyword, {}) if var_keyword else {}
        return self._run(primitive.name, **call, **options)

    method.__doc__ = primitive.method_doc()
    return method


class Schedule(ScheduleQueries):
    """A view of one submodule of the scheduled model.

    Example::

        sch = schedlang.create_schedule(model)
        sch["mlp.linear1"].shard("weight", axis=0)
        print(sch.plan)
    """

    def __init__(self, state: _RootState, path: str = ""):
        self._state = state
        self._path = path

    # ------------------------------------------------------------------ tree
    @property
    def mod(self) -> nn.Module:
        """The module at this path in the working copy, as the plan so far has made it."""
        return _get_submodule(self._state.module, self._path)

    @property
    def path(self) -> str:
        """Dotted path from the root ("" for the root)."""
        return self._path

    @property
    def name(self) -> str:
        """Last component of the path ("" for the root)."""
        return self._path.rsplit(".", 1)[-1] if self._path else ""

    @property
    def parent(self) -> Optional["Schedule"]:
        """Schedule of the parent module (None for the root)."""
        if not self._path:
            return None
        return Schedule(self._state, self._path.rsplit(".", 1)[0] if "." in self._path else "")

    @property
    def root(self) -> "Schedule":
        return Schedule(self._state, "")

    @property
    def child(self) -> Dict[str, "Schedule"]:
        """Child schedules by name, in module order (schedlang's own sync modules left out)."""
        return {n: Schedule(self._state, _join(self._path, n)) for n, _ in self.mod.named_children()
                if not _INTERNAL_CHILD.match(n)}

    def named_schedules(self, prefix: str = "") -> Iterator[Tuple[str, "Schedule"]]:
        """All schedules of this subtree, this one first, as (relative path, schedule)."""
        yield prefix, self
        for n, c in self.child.items():
            yield from c.named_schedules(_join(prefix, n))

    def __getitem__(self, path: str) -> "Schedule":
        if not isinstance(path, str):
            raise ScheduleTypeError(f"{self._display()}: schedule paths are strings like 'layers.0.mlp', got {path!r}")
        if path == "":
            return self
        module = self.mod
        walked = self._path
        for part in path.split("."):
            children = dict(module.named_children())
            if part not in children or _INTERNAL_CHILD.match(part):
                valid = [n for n in children if not _INTERNAL_CHILD.match(n)]
                raise ScheduleKeyError(
                    f"{walked or '<root>'}: no submodule '{part}' (looking up '{_join(self._path, path)}'); "
                    f"valid children: {list_names(valid)}")
            module = children[part]
            walked = _join(walked, part)
        return Schedule(self._state, walked)

    def __contains__(self, path: str) -> bool:
        try:
            self[path]
            return True
        except ScheduleKeyError:
            return False

    # ------------------------------------------------------------------ state
    @property
    def plan(self) -> Plan:
        """The ordered steps applied so far (shared by every view of this schedule)."""
        return self._state.plan

    @property
    def group(self):
        """The torch.distributed process group this schedule shards and syncs over (None: the world)."""
        return self._state.group

    @property
    def mesh(self):
        """The ``DeviceMesh`` given to :func:`create_schedule` (None when made with a group or alone)."""
        return self._state.mesh

    @property
    def world_size(self) -> int:
        return self._state.group_shape()[0]

    @property
    def rank(self) -> int:
        return self._state.group_shape()[1]

    @property
    def metadata(self) -> "ScheduleMetadata":
        """Free-form per-path notes (a primitive's summary for the report, a user's own notes), a mapping, with
        Slapo's attribute names read from the model (``tie_weights``, ``param_tags``). The facts later steps rely
        on (shards, syncs, checkpointing) are in each module's record, not here."""
        return ScheduleMetadata(self._state.metadata.setdefault(self._path, {}), self)

    def _display(self) -> str:
        return self._path or "<root>"

    def __repr__(self) -> str:
        return f"Schedule(path={self._display()!r}, module={type(self.mod).__name__}, steps={len(self.plan)})"

    def _set_module(self, new_module: nn.Module) -> None:
        """Put ``new_module`` at this path of the working copy."""
        if not self._path:
            self._state.module = new_module
            return
        parent_path, _, name = self._path.rpartition(".")
        parent = _get_submodule(self._state.module, parent_path)
        setattr(parent, name, new_module) if name in parent._modules else parent.add_module(name, new_module)

    @contextlib.contextmanager
    def atomic(self, nested_undo: bool = True) -> Iterator["Schedule"]:
        """Apply several primitives all-or-nothing: if the block raises, every step recorded in it is
        undone (modules, plan and metadata as they were) and the exception propagates.

        Each primitive is all-or-nothing too, so that code which catches a primitive's error finds the
        schedule as it was before that call; that costs a snapshot of the model per call. A block that
        catches no error of the primitives inside it can say so with ``nested_undo=False``: its own undo is
        then the only snapshot taken (``shard_model`` writes some 250 steps this way). An error caught
        inside such a block leaves the failed primitive's changes in place until the block ends.

        Example::

            with sch.atomic():
                for i in range(n_layers):
                    shard_layer(sch[f"layers.{i}"])   # a failure at layer 7 leaves layers 0-6 unsharded too
        """
        state = self._state
        if state.undo_taken_outside:  # the enclosing block's undo covers this one, and it catches nothing
            yield self
            return
        undo = _Undo(state)
        state.undo_taken_outside = not nested_undo
        try:
            yield self
        except BaseException:
            undo.restore()
            raise
        finally:
            state.undo_taken_outside = False

    def _walk(self) -> List[Tuple[str, nn.Module]]:
        """``(path, module)`` of every module of the whole model, in ``named_modules(remove_duplicate=False)``'s
        order (a shared module under each of its paths). Inside a primitive the walk is taken once and kept until
        it returns: its checks and its apply read the model before changing it (``shard`` looks for the holders
        of a tied tensor in both, for every tensor a plan splits). An apply that has changed the module tree
        and must see the new one walks it itself (``named_modules``)."""
        state = self._state
        if state.walk_of_running is not None:
            return state.walk_of_running
        walk, stack = [], [("", state.module)]
        while stack:  # without named_modules' nested generators, a cost on deep models
            path, module = stack.pop()
            walk.append((path, module))
            prefix = path + "." if path else ""
            stack.extend(reversed([(prefix + name, child) for name, child in module._modules.items()
                                   if child is not None]))
        if state.primitives_running:
            state.walk_of_running = walk
        return walk

    # ------------------------------------------------------------------ running primitives
    def _run(self, _primitive: str, /, **kwargs: Any) -> Any:
        """Check the arguments (declared types, then the primitive's own checks), apply, record."""
        primitive = get_primitive(_primitive)
        if self._state.built:
            # the built model is this schedule's model itself: a primitive now would change the model being
            # trained behind its optimizer (which keeps the old parameters) and after the plan was checked
            raise ScheduleValueError(
                f"{self._display()}: {primitive.name} after build: this schedule's model was built "
                f"(schedlang.build) and is the model you train; apply every primitive before build, or start "
                f"a new schedule (schedlang.create_schedule) to change it")
        if primitive.name not in _WITHOUT_FORWARD:
            self._refuse_if_inlined(primitive.name)
        state = self._state
        state.walk_of_running = None
        state.primitives_running += 1
        try:
            args = primitive.validate(self, **primitive.bind(self, kwargs))
            with self.atomic():
                result = primitive.apply(self, **args)
        finally:
            # whatever ran inside may have changed the model: an enclosing primitive walks it again
            state.primitives_running -= 1
            state.walk_of_running = None
        if primitive.records_step:
            self._state.plan.append(Step(primitive=primitive.name, path=self._path, args=args))
            logger.debug("step %d: %s at %s", len(self._state.plan) - 1, primitive.name, self._display())
        return result

    def _refuse_if_inlined(self, name: str) -> None:
        """A primitive acting through a module's forward on one whose forward never runs (see
        :mod:`schedlang.graph.inlined`) would do nothing or break the traced graph: refuse it up front."""
        found = inlined_by_trace(self._state.module, self._path)
        if found is None:
            return
        traced = found.traced or "<root>"
        if found.calls:
            calls = [_join(found.traced, t) for t in found.calls]
            instead = (f"calls {list_names(calls)} inside it directly; schedule those modules, or the traced graph "
                       f"through sch[{found.traced!r}].find / replace")
        else:
            instead = "uses nothing inside it"
        raise ScheduleValueError(
            f"{self._display()}: {name} needs this module's forward to run, and it never does: the graph traced "
            f"at {traced} (trace(flatten=True), or a replace that left it behind) does not call it and {instead}")

    def report(self, path: str, model: Optional[nn.Module] = None, verify=None, title: str = "") -> Optional[str]:
        """Write a self-contained HTML report of what this schedule did (see :mod:`schedlang.report`).

        Example::

            sch.report("report.html", verify=check)
        """
        from .report import write_report

        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ArgumentTypeError(f"{self._display()}: report expects the path of the HTML file to write (a str or "
                                    f"os.PathLike such as 'report.html'), got {type(path).__name__} {path!r}")
        return write_report(self.root, path, model=model, verify=verify, title=title)

    # ------------------------------------------------------------------ graph-free primitives
    # Each method's signature is checked against its primitive's declaration when this class is
    # defined; its docstring is the primitive's, and its body is the call (see _primitive_method).
    @_primitive_method
    def replace(self, new_mod_or_fn: Callable[..., Any], target_ops: Any = None, name: Optional[str] = None,
                concrete_args: Optional[Dict[str, Any]] = None): ...

    @_primitive_method
    def replace_all(self, module_type: Type[nn.Module], make_fn: Callable[..., nn.Module], *make_fn_args: Any,
                    **make_fn_kwargs: Any): ...

    @_primitive_method
    def shard(self, tensor_name: str, axis: int): ...

    @_primitive_method
    def sync(self, mode: str, sync_op_or_fn: Union[str, Callable[..., Any]] = "all_reduce", **options: Any): ...

    @_primitive_method
    def checkpoint(self, subgraph: Any = None, **options: Any): ...

    @_primitive_method
    def fork_rng(self): ...

    @_primitive_method
    def annotate(self, param_name: str, key: str, value: Any): ...

    @_primitive_method
    def decompose(self): ...

    @_primitive_method
    def float8(self, recipe: str = "tensorwise", skip: Sequence[str] = (),
               filter: Optional[Callable[[str, nn.Module], bool]] = None, min_features: int = 128,
               fsdp_float8_all_gather: bool = False, emulate: Optional[bool] = None): ...

    # ------------------------------------------------------------------ data parallelism
    @_primitive_method
    def fully_shard(self, reshard_after_forward: Optional[Union[bool, int]] = None, mp_policy: Any = None,
                    offload: bool = False): ...

    @_primitive_method
    def replicate(self, mp_policy: Any = None): ...

    # ------------------------------------------------------------------ expert parallelism
    @_primitive_method
    def expert_parallel(self, group: Any = None): ...

    # ------------------------------------------------------------------ context parallelism
    @_primitive_method
    def context_parallel(self): ...

    # ------------------------------------------------------------------ pipeline parallelism
    @_primitive_method
    def cut_pipeline_stage(self): ...

    # ------------------------------------------------------------------ graph primitives
    @_primitive_method
    def trace(self, recursive: bool = True, flatten: bool = False,
              leaf_modules: Optional[Union[str, Type[nn.Module], Sequence[Any]]] = None, tracer: str = "fx",
              concrete_args: Optional[Dict[str, Any]] = None, **options: Any): ...

    @_primitive_method
    def find(self, regex_or_pattern_fn: Union[str, Callable[..., Any]]): ...

    @_primitive_method
    def fuse(self, subgraph: Any, compiler: Optional[str] = "triton", name: str = "FusedModule"): ...

    @_primitive_method
    def horizontal_fuse(self, rules: Optional[Sequence[str]] = None, min_group_size: int = 2,
                        example_inputs: Optional[Sequence[torch.Tensor]] = None): ...

    @_primitive_method
    def combine_sparse_features(self, features: Sequence[Sequence[str]],
                                names: Sequence[str] = ("sparse_indices", "sparse_lengths")): ...

    @_primitive_method
    def overlap_communication(self, hoist: bool = True): ...


def _get_submodule(root: nn.Module, path: str) -> nn.Module:
    module = root
    if path:
        for part in path.split("."):
            module = module._modules[part]
    return module


def create_schedule(model: nn.Module = None, name: str = "", path: str = "", parent: Optional[Schedule] = None,
                    group=None, mesh=None, **kwargs: Any) -> Schedule:
    """Wrap ``model`` in a root :class:`Schedule`.

    ``group`` is the torch.distributed process group to shard and sync over (default: the
    world, when torch.distributed is initialized): a 1-D tensor-parallel mesh. ``mesh`` is a
    ``DeviceMesh`` whose dimensions are named from ``pp``, ``dp`` (or ``dp_replicate`` and
    ``dp_shard`` for HSDP) and ``tp`` (see :mod:`schedlang.distributed.mesh`): ``shard`` and
    ``sync`` act on its ``tp`` dimension (on this rank alone when it has none), ``fully_shard``
    and ``replicate`` on its data dimensions, ``cut_pipeline_stage`` on ``pp``. Give one or the
    other. The schedule works on a deep copy of ``model``; the model you pass is never changed.

    The arguments before ``group`` are Slapo's (``root`` is accepted for ``model``): ``name``
    and ``path`` say where ``model`` sits in a larger model. Without ``parent`` they are kept
    as labels (``sch.path`` stays relative to ``model``: ``""`` at the root, so plans replay on
    ``model`` alone). With ``parent`` (a schedule), ``model`` must be the module at ``path``
    of the parent's model, and the result is ``parent.get_top_schedule()[path]``: a view that
    shares the parent's plan.

    Example::

        sch = schedlang.create_schedule(model)
        print(sch["layers.0"].mod)

        mesh = schedlang.distributed.mesh.make_mesh(dp=2, tp=2)   # under torchrun, 4 ranks
        sch = schedlang.create_schedule(model, mesh=mesh)
    """
    if model is None and "root" in kwargs:
        model = kwargs.pop("root")
    if kwargs:
        raise ScheduleTypeError(f"create_schedule: unknown arguments {', '.join(sorted(kwargs))}; valid "
                                "arguments are model (or root), name, path, parent, group, mesh")
    if not isinstance(model, nn.Module):
        raise ScheduleTypeError(f"create_schedule: the model must be a torch.nn.Module, got {type(model).__name__}")
    for label, value in (("name", name), ("path", path)):
        if not isinstance(value, str):
            raise ScheduleTypeError(
                f"create_schedule: {label} must be a string (Slapo's module {label}, '' for a whole model), got "
                f"{type(value).__name__} {value!r}; pass a process group as group=, a DeviceMesh as mesh=")
    if parent is not None:
        return _view_in_parent(model, path, parent, group, mesh)
    _check_group(group)
    if mesh is not None:
        from .distributed.mesh import check_mesh, tp_group

        if group is not None:
            raise ScheduleTypeError("create_schedule: give either group= (a 1-D tensor-parallel process group) or "
                                    "mesh= (a DeviceMesh with named pp/dp/tp dimensions), not both")
        check_mesh(mesh)
        group = tp_group(mesh)
    state = _RootState(copy.deepcopy(model), model, group, mesh)
    #: Slapo's labels of where ``model`` sits in a larger model (paths here stay relative to it)
    state.slapo_name, state.slapo_path = name, path
    return Schedule(state)


def _check_group(group: Any) -> None:
    """Refuse a ``group=`` that is not a process group now, rather than at the first collective or ``build``."""
    if group is None or isinstance(group, groups.SingleRankGroup):  # the world; a mesh without a 'tp' dimension
        return
    process_group = getattr(torch.distributed, "ProcessGroup", None) if torch.distributed.is_available() else None
    if process_group is not None and isinstance(group, process_group):
        return
    raise ArgumentTypeError(f"create_schedule: group must be a torch.distributed ProcessGroup (e.g. from "
                            f"torch.distributed.new_group) or None (the world), got {type(group).__name__} "
                            f"{group!r}; pass a DeviceMesh as mesh=, not as group=")


def _view_in_parent(model: nn.Module, path: str, parent: Any, group: Any, mesh: Any) -> Schedule:
    """Slapo's ``create_schedule(..., parent=sch)``: the view of ``model`` inside the parent's schedule."""
    if not isinstance(parent, Schedule):
        raise ScheduleTypeError(f"create_schedule: parent must be a Schedule (or None for a new schedule), got "
                                f"{type(parent).__name__}")
    if group is not None or mesh is not None:
        raise ScheduleValueError("create_schedule: a schedule made with parent= uses the parent's process group "
                                 "and mesh; pass group= and mesh= only to the parent's create_schedule")
    top = parent.get_top_schedule()
    if path:
        view = top[path]
    else:
        found = [p for p, m in top.mod.named_modules() if m is model]
        found += [p for p, m in top._state.original.named_modules() if m is model and p in top]
        if not found:
            raise ScheduleValueError(
                f"create_schedule: the {type(model).__name__} given with parent= is not a module of the parent "
                "schedule's model; pass path= (its dotted path from the top, e.g. 'layers.0')")
        view = top[found[0]]
    original = top._state.original
    at_path = dict(original.named_modules(remove_duplicate=False)).get(view.path)
    if model is not view.mod and model is not at_path:
        raise ScheduleValueError(
            f"create_schedule: the parent schedule has a {type(view.mod).__name__} at path '{view.path}', not the "
            f"{type(model).__name__} given; pass the module at that path (parent['{view.path}'].mod) or its path")
    return view
