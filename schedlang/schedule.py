"""The ``Schedule``: a tree of views over a model, with one typed method per primitive.

A schedule never changes the user's model. ``create_schedule`` deep-copies it once (free
for a model on the meta device) and every primitive works on that copy. A ``Schedule``
object is a light view: the shared root state plus a dotted path, so ``sch["layers.0"]``
always shows the module that is at that path *now*, after replacements and tracing.

Each primitive call checks its arguments first, then changes the working copy; if the
change itself fails, the tree is restored, so nothing is ever half-applied. A successful
call is recorded as a :class:`~schedlang.plan.Step` of ``sch.plan``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Type, Union

import torch
from torch import nn

from .distributed import groups
from .errors import ScheduleKeyError, ScheduleTypeError
from .plan import Plan, Step
from .primitives.base import get_primitive

__all__ = ["Schedule", "create_schedule"]

logger = logging.getLogger("schedlang.schedule")

_INTERNAL_CHILD = re.compile(r"^_schedlang_")


class _RootState:
    """What all views of one schedule share."""

    def __init__(self, module: nn.Module, original: nn.Module, group, mesh=None):
        self.module = module
        self.original = original
        self.group = group
        self.mesh = mesh
        self.plan = Plan()
        self.metadata: Dict[str, Dict[str, Any]] = {}


class _TreeSnapshot:
    """Shallow copy of every module's attribute dictionaries, to undo a failed primitive.

    Primitives never change tensors in place (they swap in new ``Parameter`` objects,
    child modules and hooks), so restoring the dictionaries restores the tree.
    """

    def __init__(self, state: _RootState):
        self.state = state
        self.root = state.module
        self.saved = []
        for m in self.root.modules():
            d = dict(m.__dict__)
            for key, value in d.items():
                if isinstance(value, dict):
                    d[key] = type(value)(value) if type(value) is not dict else dict(value)
                elif isinstance(value, list):
                    d[key] = list(value)
            self.saved.append((m, m.__class__, d))

    def restore(self) -> None:
        self.state.module = self.root
        for m, klass, d in self.saved:
            m.__dict__.clear()
            m.__dict__.update(d)
            m.__class__ = klass


class Schedule:
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
                shown = ", ".join(valid[:20]) + (", ..." if len(valid) > 20 else "") if valid else "none (a leaf module)"
                raise ScheduleKeyError(
                    f"{walked or '<root>'}: no submodule '{part}' (looking up '{_join(self._path, path)}'); "
                    f"valid children: {shown}")
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
        return groups.world_size(self._state.group)

    @property
    def rank(self) -> int:
        return groups.rank(self._state.group)

    @property
    def metadata(self) -> Dict[str, Any]:
        """Free-form per-path metadata (primitives record what they did here)."""
        return self._state.metadata.setdefault(self._path, {})

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
    def atomic(self) -> Iterator["Schedule"]:
        """Apply several primitives all-or-nothing: if the block raises, every step recorded in it is
        undone (modules, plan and metadata as they were) and the exception propagates.

        Example::

            with sch.atomic():
                for i in range(n_layers):
                    shard_layer(sch[f"layers.{i}"])   # a failure at layer 7 leaves layers 0-6 unsharded too
        """
        state = self._state
        snapshot = _TreeSnapshot(state)
        steps = len(state.plan)
        metadata = {path: {k: (type(v)(v) if isinstance(v, (dict, list)) else v) for k, v in entry.items()}
                    for path, entry in state.metadata.items()}
        try:
            yield self
        except BaseException:
            snapshot.restore()
            state.plan._truncate(steps)
            state.metadata.clear()
            state.metadata.update(metadata)
            raise

    # ------------------------------------------------------------------ running primitives
    def _run(self, _primitive: str, /, **kwargs: Any) -> Any:
        name = _primitive
        primitive = get_primitive(name)
        args = primitive.validate(self, **kwargs)
        snapshot = _TreeSnapshot(self._state)
        try:
            result = primitive.apply(self, **args)
        except BaseException:
            snapshot.restore()
            raise
        if getattr(primitive, "records_step", True):
            self._state.plan.append(Step(primitive=name, path=self._path, args=args))
            logger.debug("step %d: %s at %s", len(self._state.plan) - 1, name, self._display())
        return result

    def report(self, path: str, model: Optional[nn.Module] = None, verify=None, title: str = "") -> Optional[str]:
        """Write a self-contained HTML report of what this schedule did (see :mod:`schedlang.report`).

        Example::

            sch.report("report.html", verify=check)
        """
        from .report import write_report

        return write_report(self.root, path, model=model, verify=verify, title=title)

    # ------------------------------------------------------------------ graph-free primitives
    def replace(self, new_mod_or_fn: Union[nn.Module, Callable], target_ops=None, name: Optional[str] = None):
        """Replace this module by ``new_mod_or_fn``, or, with ``target_ops`` (subgraphs from
        :meth:`find`), replace those subgraphs of the traced module by it.

        Example::

            sch["mlp"].replace(FastMLP.from_module(sch["mlp"].mod))
        """
        return self._run("replace", new_mod_or_fn=new_mod_or_fn, target_ops=target_ops, name=name)

    def replace_all(self, module_type: Type[nn.Module], make_fn: Callable[[str, nn.Module], nn.Module]):
        """Replace every submodule of type ``module_type`` under this path by ``make_fn(path, old_module)``.

        Example::

            sch.replace_all(nn.GELU, lambda name, old: FastGELU())
        """
        return self._run("replace_all", module_type=module_type, make_fn=make_fn)

    def shard(self, tensor_name: str, axis: int):
        """Split parameter or buffer ``tensor_name`` of this module along ``axis`` over the group.

        Example (Megatron MLP)::

            sch["fc1"].shard("weight", axis=0); sch["fc1"].shard("bias", axis=0)
            sch["fc2"].shard("weight", axis=1)
        """
        return self._run("shard", tensor_name=tensor_name, axis=axis)

    def sync(self, mode: str, sync_op_or_fn: Union[str, Callable] = "all_reduce", **kwargs: Any):
        """Insert a synchronization: ``mode`` in ``fwd_pre``, ``fwd_post``, ``bwd_post``;
        op ``all_reduce``, ``all_gather`` (``axis=``), ``reduce_scatter`` (``axis=``) or a callable.

        Example::

            sch["fc2"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
            sch["fc1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        """
        return self._run("sync", mode=mode, sync_op_or_fn=sync_op_or_fn, **kwargs)

    def checkpoint(self, subgraph=None, **kwargs: Any):
        """Recompute this module's activations in backward (``torch.utils.checkpoint``, non-reentrant);
        with ``subgraph`` (from :meth:`find`), only that part of the traced module.

        Example::

            for i in range(n_layers): sch[f"layers.{i}"].checkpoint()
        """
        return self._run("checkpoint", subgraph=subgraph, **kwargs)

    def fork_rng(self):
        """Give this module's random ops (dropout) a per-rank random stream, as tensor-parallel
        regions need, without disturbing the default stream the rest of the model uses."""
        return self._run("fork_rng")

    def annotate(self, param_name: str, key: str, value: Any):
        """Attach ``key = value`` to parameter ``param_name`` (kept through build and replay)."""
        return self._run("annotate", param_name=param_name, key=key, value=value)

    def decompose(self):
        """Turn an ``nn.Linear`` into a matmul followed by a separate bias add, so that the bias
        add can be fused with what follows."""
        return self._run("decompose")

    def float8(self, recipe: str = "tensorwise", skip: Sequence[str] = (), filter: Optional[Callable] = None,
               min_features: int = 128, fsdp_float8_all_gather: bool = False, emulate: Optional[bool] = None):
        """Train the Linears under this module in float8 (``torchao.float8``; ``pip install 'schedlang[fp8]'``).

        ``recipe``: ``"tensorwise"`` (one dynamic scale per tensor), ``"rowwise"`` or
        ``"rowwise_with_gw_hp"``. Linears whose dimensions are not multiples of 16, the LM head and
        Linears smaller than ``min_features`` on a side stay in their dtype (reasons are logged and
        returned); ``skip`` (fnmatch patterns of module paths) and ``filter(path, module) -> bool``
        exclude more. ``fsdp_float8_all_gather`` lets FSDP2 all-gather the weights in float8.
        ``emulate`` (default: when the GPU has no float8 tensor cores) computes in high precision.
        Call it after ``shard``, so tensor-parallel shards are checked as they will run.

        Example::

            for i in range(n_layers):
                sch[f"model.layers.{i}"].float8()
        """
        return self._run("float8", recipe=recipe, skip=skip, filter=filter, min_features=min_features,
                         fsdp_float8_all_gather=fsdp_float8_all_gather, emulate=emulate)

    # ------------------------------------------------------------------ data parallelism
    def fully_shard(self, reshard_after_forward: Optional[Union[bool, int]] = None, mp_policy=None,
                    offload: bool = False):
        """FSDP2 on the mesh's data-parallel dimension for this module's parameters, carried out by
        :func:`schedlang.build` (see :mod:`schedlang.primitives.fully_shard` for the options).

        Example::

            for i in range(n_layers): sch[f"model.layers.{i}"].fully_shard()
            sch.fully_shard()
        """
        return self._run("fully_shard", reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                         offload=offload)

    def replicate(self, mp_policy=None):
        """DDP on the mesh's ``dp`` dimension (gradients all-reduced), carried out by :func:`schedlang.build`.

        Example::

            sch.replicate()
        """
        return self._run("replicate", mp_policy=mp_policy)

    # ------------------------------------------------------------------ pipeline parallelism
    def cut_pipeline_stage(self):
        """End a pipeline stage after this module; ``n`` cuts make ``n + 1`` stages, split and run on
        the mesh's ``pp`` dimension by ``schedlang.build(sch, pipeline={...})`` (see
        :mod:`schedlang.primitives.cut_pipeline_stage`).

        Example::

            sch["model.layers.1"].cut_pipeline_stage()   # stage 0: embeddings, layers 0-1; stage 1: the rest
        """
        return self._run("cut_pipeline_stage")

    # ------------------------------------------------------------------ graph primitives
    def trace(self, recursive: bool = True, flatten: bool = False, leaf_modules=None, tracer: str = "fx",
              concrete_args: Optional[Dict[str, Any]] = None):
        """Trace this submodule into an FX graph (hierarchy kept unless ``flatten``).

        ``leaf_modules`` lists module types or qualified names to keep as calls. A tensor in
        ``concrete_args`` is an example input (its shape guides Python control flow); any other
        value is fixed in the graph; ``schedlang.graph.PH`` keeps an argument an input.
        Failures raise :class:`schedlang.TraceError` naming the submodule and the cause.

        Example::

            sch["mlp"].trace(flatten=True)
        """
        return self._run("trace", recursive=recursive, flatten=flatten, leaf_modules=leaf_modules, tracer=tracer,
                         concrete_args=concrete_args)

    def find(self, regex_or_pattern_fn):
        """Find nodes of the traced module: a regex over module names, or a pattern function
        matched by dataflow (returns a list of subgraphs).

        Example::

            subgraphs = sch["mlp"].find(lambda x, b: F.gelu(x + b))
        """
        return self._run("find", regex_or_pattern_fn=regex_or_pattern_fn)

    def fuse(self, subgraph, compiler: str = "triton", name: str = "FusedModule"):
        """Fuse a found subgraph into one submodule lowered by ``compiler`` (``triton``,
        ``inductor`` or ``eager``).

        Example::

            sch["mlp"].fuse(subgraphs, compiler="triton", name="BiasGeLU")
        """
        return self._run("fuse", subgraph=subgraph, compiler=compiler, name=name)

    def horizontal_fuse(self, rules: Optional[Sequence[str]] = None, min_group_size: int = 2):
        """Apply the atomic horizontal-fusion rules to the traced module until nothing changes;
        returns a report of what was fused."""
        return self._run("horizontal_fuse", rules=rules, min_group_size=min_group_size)


    def combine_sparse_features(self, features, names=("sparse_indices", "sparse_lengths")):
        """Make the traced forward take its sparse inputs, given as (indices_input, lengths_input)
        name pairs, as one combined (indices, lengths) pair split on the device; returns the layout.

        Example::

            layout = sch.combine_sparse_features([("user_ids", "user_lengths"), ("item_ids", "item_lengths")])
            indices, lengths = layout.combine(batch, pin_memory=True)
        """
        return self._run("combine_sparse_features", features=features, names=names)

    def overlap_communication(self, hoist: bool = True):
        """Issue the traced module's forward collectives asynchronously and wait just before the
        first use, so independent computation runs meanwhile; returns a report.

        Example::

            sch.trace(flatten=True)
            print(sch.overlap_communication())
        """
        return self._run("overlap_communication", hoist=hoist)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _get_submodule(root: nn.Module, path: str) -> nn.Module:
    module = root
    if path:
        for part in path.split("."):
            module = module._modules[part]
    return module


def create_schedule(model: nn.Module, group=None, mesh=None) -> Schedule:
    """Wrap ``model`` in a root :class:`Schedule`.

    ``group`` is the torch.distributed process group to shard and sync over (default: the
    world, when torch.distributed is initialized): a 1-D tensor-parallel mesh. ``mesh`` is a
    ``DeviceMesh`` whose dimensions are named from ``pp``, ``dp`` (or ``dp_replicate`` and
    ``dp_shard`` for HSDP) and ``tp`` (see :mod:`schedlang.distributed.mesh`): ``shard`` and
    ``sync`` act on its ``tp`` dimension (on this rank alone when it has none), ``fully_shard``
    and ``replicate`` on its data dimensions, ``cut_pipeline_stage`` on ``pp``. Give one or the
    other. The schedule works on a deep copy of ``model``; the model you pass is never changed.

    Example::

        sch = schedlang.create_schedule(model)
        print(sch["layers.0"].mod)

        mesh = schedlang.distributed.mesh.make_mesh(dp=2, tp=2)   # under torchrun, 4 ranks
        sch = schedlang.create_schedule(model, mesh=mesh)
    """
    if not isinstance(model, nn.Module):
        raise ScheduleTypeError(f"create_schedule expects a torch.nn.Module, got {type(model).__name__}")
    if mesh is not None:
        from .distributed.mesh import check_mesh, tp_group

        if group is not None:
            raise ScheduleTypeError("create_schedule: give either group= (a 1-D tensor-parallel process group) or "
                                    "mesh= (a DeviceMesh with named pp/dp/tp dimensions), not both")
        check_mesh(mesh)
        group = tp_group(mesh)
    return Schedule(_RootState(copy.deepcopy(model), model, group, mesh))
