"""``fully_shard(reshard_after_forward=None, mp_policy=None, offload=False)``: FSDP2 on the mesh's data dimension.

Each parameter under this module is split over the ranks of the data-parallel dimension (``dp``,
or ``dp_replicate`` x ``dp_shard`` for HSDP) and gathered just before the module runs; gradients
are reduce-scattered after its backward. On top of tensor parallelism this is a 2-D layout: a
parameter that is a DTensor sharded on ``tp`` is sharded again on ``dp``.

Call it on each repeated block, then on the root, as FSDP2 wants: a block's parameters are then
gathered one block at a time, and the root collects what is left (embeddings, final norm, head).
The step is recorded now and carried out by :func:`schedlang.build` (it does not change the
single-replica numerics, so ``Verify`` has nothing to compare).

Options:

* ``reshard_after_forward``: free the gathered parameters after forward (True, FSDP2's default,
  least memory), keep them for backward (False, one all-gather less per step), or reshard to a
  smaller group of that many ranks (an int).
* ``mp_policy``: ``None`` (bf16 parameters and fp32 gradient reduction on a GPU, fp32 on a CPU),
  ``"bf16"``, ``"fp32"``, a dict of dtype names, or a ``torch.distributed.fsdp.MixedPrecisionPolicy``.
* ``offload``: keep the sharded parameters and optimizer state in CPU memory (FSDP2's CPU offload).

Example::

    sch = schedlang.create_schedule(model, mesh=make_mesh(dp=2))
    for i in range(config.num_hidden_layers):
        sch[f"model.layers.{i}"].fully_shard()
    sch.fully_shard()
    model, opt = schedlang.build(sch, optimizer=torch.optim.AdamW, lr=3e-4)
"""

from __future__ import annotations

from typing import Any, Optional, Union

from ..distributed.data_parallel import data_parallel_step_args
from ..errors import ScheduleValueError
from .base import Param, Primitive, register_primitive

#: how ``mp_policy`` is declared for ``fully_shard`` and ``replicate``
MP_POLICY = Param("mp_policy", Any, None, "mixed precision: None (bf16 on GPUs, fp32 on CPUs), 'bf16', 'fp32', "
                                          "a dict of dtype names or a MixedPrecisionPolicy")


@register_primitive
class FullyShard(Primitive):
    """FSDP2 on the mesh's data-parallel dimension for this module's parameters, carried out by
    :func:`schedlang.build` (see :mod:`schedlang.primitives.fully_shard` for the options).

    Example::

        for i in range(n_layers): sch[f"model.layers.{i}"].fully_shard()
        sch.fully_shard()
    """

    name = "fully_shard"
    params = (
        Param("reshard_after_forward", Optional[Union[bool, int]], None,
              "free gathered parameters after forward (True), keep them (False), or reshard to that many ranks",
              expects="None, a bool or an int (ranks to reshard to)"),
        MP_POLICY,
        Param("offload", bool, False, "keep sharded parameters and optimizer state in CPU memory"),
    )

    @classmethod
    def validate(cls, sch, reshard_after_forward=None, mp_policy=None, offload=False):
        where = sch.path or "<root>"
        if type(reshard_after_forward) is int and reshard_after_forward < 1:
            raise ScheduleValueError(f"{where}: reshard_after_forward as a group size must be >= 1, got "
                                     f"{reshard_after_forward}")
        return {"reshard_after_forward": reshard_after_forward, "offload": offload,
                **data_parallel_step_args(sch, cls.name, mp_policy)}

    @classmethod
    def apply(cls, sch, **args):
        return None  # carried out by build, once the whole plan is known
