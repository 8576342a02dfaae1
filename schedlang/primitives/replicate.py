"""``replicate(mp_policy=None)``: DDP on the mesh's ``dp`` dimension.

Every rank of the ``dp`` dimension keeps all parameters of this module (its tensor-parallel
shards, on a 2-D mesh) and gradients are all-reduced over ``dp`` in backward. It is built on
torch's composable ``replicate``, which keeps parameter names, so checkpoints and exports see
the same keys as without it. Usually called once, at the root. Like ``fully_shard`` it is
recorded now and carried out by :func:`schedlang.build`.

``mp_policy`` is as in :mod:`schedlang.primitives.fully_shard`.

With fp32 master weights (``build(..., optimizer="adamw", master_weights=True)``) the step runs on
torch's DDP instead: the parameters stay the plain bf16 tensors whose fp32 masters the fused AdamW
keeps, gradients are all-reduced in 100 MB buckets while the backward still runs, in the policy's
``reduce_dtype`` (fp32 by default; ``mp_policy={"reduce_dtype": "bfloat16"}`` sums them as they are, which
over two ranks gives the same bits), and one DDP at the outermost ``replicate`` covers any inside it.
Such a schedule needs a 1-D data mesh and no tensor parallelism or ``fully_shard`` (``build`` says so
before changing anything). See :mod:`schedlang.distributed.data_parallel`.

Example::

    sch = schedlang.create_schedule(model, mesh=make_mesh(dp=2, tp=2))
    shard_model(sch)            # tensor parallel inside each pair of ranks
    sch.replicate()             # data parallel across the pairs
    model, opt = schedlang.build(sch, optimizer=torch.optim.AdamW, lr=3e-4)

    # DDP over bf16 weights with fp32 masters in the optimizer
    sch = schedlang.create_schedule(model, mesh=make_mesh(dp=8))
    sch.replicate()
    model, opt = schedlang.build(sch, optimizer="adamw", lr=3e-4, master_weights=True)
"""

from __future__ import annotations

from ..distributed.data_parallel import data_parallel_step_args
from .base import Primitive, register_primitive
from .fully_shard import MP_POLICY


@register_primitive
class Replicate(Primitive):
    """DDP on the mesh's ``dp`` dimension (gradients all-reduced), carried out by :func:`schedlang.build`.

    Example::

        sch.replicate()
    """

    name = "replicate"
    params = (MP_POLICY,)

    @classmethod
    def validate(cls, sch, mp_policy=None):
        return data_parallel_step_args(sch, cls.name, mp_policy)

    @classmethod
    def apply(cls, sch, **args):
        return None  # carried out by build, once the whole plan is known
