"""Steps shared by the model schedules: column / row pairs, vocabulary-parallel embedding and LM head."""

from __future__ import annotations

import functools
from typing import List, Tuple

from torch import nn

from ..errors import ScheduleTypeError
from ..module_record import shard_specs

SEQUENCE_AXIS = 1


def all_or_nothing(sch):
    """Undo every step recorded inside the block if one of them fails, so that a model schedule that
    stops halfway (a head count that does not divide, say) leaves the schedule as it found it."""
    return sch.root.atomic()


def model_schedule(fn):
    """Decorator: run a ``shard_<family>(sch, ...)`` helper all-or-nothing (see :func:`all_or_nothing`)."""

    @functools.wraps(fn)
    def wrapper(sch, *args, **kwargs):
        with all_or_nothing(sch):
            return fn(sch, *args, **kwargs)

    return wrapper


def base_and_prefix(sch, layers_name: str, family: str) -> Tuple[object, str]:
    """The schedule whose child ``layers_name`` holds the transformer layers (``sch`` or a descendant)."""
    frontier = [sch]
    for _ in range(4):
        for s in frontier:
            if layers_name in s.child and isinstance(s[layers_name].mod, nn.ModuleList):
                return s, s.path
        frontier = [c for s in frontier for c in s.child.values()]
    raise ScheduleTypeError(f"{sch.path or '<root>'}: {type(sch.mod).__name__} does not look like a {family} model: "
                            f"no '{layers_name}' ModuleList found within 4 levels; pass the schedule of a {family} "
                            "model or of its base model")


def _is_conv1d(module: nn.Module) -> bool:
    return any(k.__name__ == "Conv1D" for k in type(module).__mro__)


def _sharded(sch, name: str) -> bool:
    return name in shard_specs(sch.mod)


def shard_column(sch) -> None:
    """Column parallel: split the outputs (Linear weight axis 0, Conv1D weight axis 1) and the bias."""
    module = sch.mod
    if not (isinstance(module, nn.Linear) or _is_conv1d(module)):
        raise ScheduleTypeError(f"{sch.path}: expected an nn.Linear or Conv1D, found {type(module).__name__}")
    if not _sharded(sch, "weight"):
        sch.shard("weight", axis=1 if _is_conv1d(module) else 0)
    if getattr(module, "bias", None) is not None and not _sharded(sch, "bias"):
        sch.shard("bias", axis=0)


def shard_row(sch) -> None:
    """Row parallel: split the inputs (Linear weight axis 1, Conv1D weight axis 0); the bias stays whole."""
    module = sch.mod
    if not (isinstance(module, nn.Linear) or _is_conv1d(module)):
        raise ScheduleTypeError(f"{sch.path}: expected an nn.Linear or Conv1D, found {type(module).__name__}")
    sch.shard("weight", axis=0 if _is_conv1d(module) else 1)


def shard_linear_pair(layer, block, columns: List[str], row: str, sequence_parallel: bool, norm: str,
                      grad_sync_at_norm: bool = False) -> None:
    """Megatron pair: ``columns`` column parallel, ``row`` row parallel, and the syncs around them.

    Tensor parallel: all-reduce the row's output, all-reduce the block input's gradient (on the
    block's input, or with ``grad_sync_at_norm`` on the output of the norm that feeds it).
    Sequence parallel: all-gather the norm's output along the sequence before the block, and
    reduce-scatter the row's output along the sequence.
    """
    for name in columns:
        shard_column(block[name])
    shard_row(block[row])
    if sequence_parallel:
        layer[norm].sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=SEQUENCE_AXIS,
                         tensor_parallel_output_grad=True)
        block[row].sync(mode="fwd_post", sync_op_or_fn="reduce_scatter", axis=SEQUENCE_AXIS)
    else:
        block[row].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        if grad_sync_at_norm:
            from ..distributed.sequence_parallel import AllReduceGradient

            layer[norm].sync(mode="fwd_post", sync_op_or_fn=AllReduceGradient(layer.group))
        else:
            block.sync(mode="bwd_post", sync_op_or_fn="all_reduce")


def shard_vocab_embedding(emb) -> None:
    """Vocabulary-parallel embedding: split the rows, all-reduce the (zero-masked) lookups."""
    if not _sharded(emb, "weight"):
        emb.shard("weight", axis=0)
    emb.sync(mode="fwd_post", sync_op_or_fn="all_reduce")


def split_sequence_at(layer) -> None:
    from ..distributed.sequence_parallel import split_sequence

    split_sequence(layer, axis=SEQUENCE_AXIS)


def finish_lm_head(sch, base, final_norm: str, sequence_parallel: bool, gather_logits: bool,
                   head_path: str = "lm_head", install_loss: bool = True) -> None:
    """Gather the final norm's output (sequence parallel) and make the LM head vocabulary parallel."""
    has_head = head_path in sch
    if sequence_parallel:
        base[final_norm].sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=SEQUENCE_AXIS,
                              tensor_parallel_output_grad=has_head)
    if not has_head:
        return
    head = sch[head_path]
    shard_column(head)
    if not sequence_parallel:
        head.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    if gather_logits:
        head.sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=-1, tensor_parallel_output_grad=False)
    elif install_loss and hasattr(type(sch.root.mod), "loss_function"):
        from ..distributed.cross_entropy import use_vocab_parallel_loss

        use_vocab_parallel_loss(sch)


class _GroupRef:
    """Holds a process group; copies of a model share it (process groups cannot be deep-copied)."""

    def __init__(self, group):
        self.group = group

    def __deepcopy__(self, memo):
        return self


_GRAD_SUM_ATTR = "_schedlang_tensor_parallel_grad_group"
_GRAD_SUMMED = {}


def _grad_summed_forward(self, *args, **kwargs):
    from ..distributed.collectives import reduce_backward

    group = self.__dict__[_GRAD_SUM_ATTR].group
    own = self.__dict__["_parameters"]
    # the forward reads its parameters through an identity whose backward sums their gradients
    self.__dict__["_parameters"] = {n: (reduce_backward(p, group) if p is not None and p.requires_grad else p)
                                    for n, p in own.items()}
    try:
        return type(self).__mro__[1].forward(self, *args, **kwargs)
    finally:
        self.__dict__["_parameters"] = own


def gradient_summed(module: nn.Module, group=None) -> nn.Module:
    """A module computing as ``module`` (sharing its parameters) whose parameter gradients are summed over
    ``group`` in backward: for replicated weights applied to a rank's own heads (Qwen3's ``q_norm``), whose
    gradient on each rank covers only those heads."""
    if _GRAD_SUM_ATTR in module.__dict__:
        return module
    base = type(module)
    klass = _GRAD_SUMMED.get(base)
    if klass is None:
        klass = type(f"TensorParallel{base.__name__}", (base,), {"forward": _grad_summed_forward,
                                                                 "__module__": __name__})
        _GRAD_SUMMED[base] = klass
        globals()[klass.__name__] = klass  # importable by name, so a scheduled model can be pickled
    new = base.__new__(klass)
    new.__dict__.update({k: (type(v)(v) if isinstance(v, dict) else v) for k, v in module.__dict__.items()})
    new.__dict__[_GRAD_SUM_ATTR] = _GroupRef(group)
    return new
