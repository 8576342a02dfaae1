"""``replicate(mp_policy=None)``: DDP on the mesh's ``dp`` dimension.

Every rank of the ``dp`` dimension keeps all parameters of this module (its tensor-parallel
shards, on a 2-D mesh) and gradients are all-reduced over ``dp`` in backward. It is built on
torch's composable ``replicate``, which keeps parameter names, so checkpoints and exports see
the same keys as without it. Usually called once, at the root. Like ``fully_shard`` it is
recorded now and carried out by :func:`schedlang.build`.

``mp_policy`` is as in :mod:`schedlang.primitives.fully_shard`.

Example::

    sch = schedlang.create_schedule(model, mesh=make_mesh(dp=2, tp=2))
    shard_model(sch)            # tensor parallel inside each pair of ranks
    sch.replicate()             # data parallel across the pairs
    model, opt = schedlang.build(sch, optimizer=torch.optim.AdamW, lr=3e-4)
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
