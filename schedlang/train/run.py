"""One rank's run: the mesh, the model built through a schedule (tensor, sequence, data and pipeline
parallelism), the optimizer, one training step with its loss and gradient clipping, checkpoints."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from .configs import _model_class, build_meta_model, model_config, model_dims, validate_model
from .structure import decoder_layers, flops_params, stage_cuts, tied_names
from .data import _mix, lr_at
from .experts import check_expert_counts, count_experts, expert_load, make_expert_mesh, spread_experts, \
    start_expert_load, track_expert_load, weigh_expert_gradients
from .flags import TrainError

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None

logger = logging.getLogger("schedlang.train")


class _Run:
    """One rank's view of the run: mesh, model, optimizer, data slice."""

    def __init__(self, ns, rank: int, world: int, device: torch.device):
        self.ns, self.rank, self.world, self.device = ns, rank, world, device
        self.mesh = None
        self.dp_rank = 0
        self.tp_group = None
        self.pipelined = ns.pp > 1
        self.cp = getattr(ns, "cp", None) or 1
        self.expert_mesh = None  # --ep: the ("ep", "ep_replicate") mesh (train/experts.py)
        #: where build allocates the weights and the optimizer: here, or in a FakeTensorMode (--trace-memory)
        self.materialize_mode = contextlib.nullcontext()

    # -- layout
    def make_mesh(self) -> None:
        if self.world == 1:
            return
        from ..distributed.mesh import make_mesh

        ns = self.ns
        replicas = getattr(ns, "dp_replicate", None) or 1  # HSDP: dp = replicas x shard ranks
        self.mesh = make_mesh(pp=ns.pp, dp=ns.dp // replicas, tp=ns.tp, dp_replicate=replicas,
                              cp=self.cp, device_type=self.device.type)
        if replicas > 1:  # the rows of a replica's shard group follow one another
            self.dp_rank = self.mesh.get_local_rank("dp_replicate") * (ns.dp // replicas) + \
                self.mesh.get_local_rank("dp_shard")
        else:
            self.dp_rank = self.mesh.get_local_rank("dp")
        self.tp_group = self.mesh["tp"].get_group() if ns.tp > 1 else None
        self.pp_rank = self.mesh.get_local_rank("pp")
        make_expert_mesh(self)

    def layout(self) -> str:
        ns = self.ns
        s = f"pp={ns.pp} dp={ns.dp} tp={ns.tp}" + (f" cp={self.cp}" if self.cp > 1 else "") + (
            f" ep={ns.ep}" if (getattr(ns, "ep", None) or 1) > 1 else "")
        extras = []
        if ns.sp:
            extras.append("sp")
        if ns.dp > 1:
            mode = f"hsdp {ns.dp_replicate}x{ns.dp_shard}" if ns.dp_mode == "hsdp" else ns.dp_mode
            extras.append(mode + (" no-reshard" if ns.no_reshard else "")
                          + (" bf16-reduce" if ns.reduce_dtype == "bf16" else ""))
        if ns.pp > 1:
            extras.append(f"{ns.pp_schedule} x{ns.microbatches} mb")
        return s + (f" ({', '.join(extras)})" if extras else "")

    # -- model
    def build(self) -> None:
        import schedlang
        from ..models import compile_layers, shard_model

        ns = self.ns
        self.cfg = model_config(ns.model, ns.config)
        self.dims = model_dims(self.cfg)
        validate_model(ns, self.dims, self.cfg)
        model = build_meta_model(self.cfg)
        layers, layer_list = decoder_layers(model)
        self.dims.layers = len(layer_list)
        self.flops_params = flops_params(model)
        tied = tied_names(model)
        self.n_params = sum(p.numel() for p in model.parameters())
        check_expert_counts(ns, count_experts(model))
        sch = schedlang.create_schedule(model, mesh=self.mesh) if self.mesh is not None else \
            schedlang.create_schedule(model)
        del model
        if ns.tp > 1:
            shard_model(sch, sequence_parallel=ns.sp, gather_logits=False)
        if self.cp > 1:  # each cp rank runs its part of every sequence; build averages the gradients over cp
            sch.context_parallel()
        spread_experts(self, sch)  # before the data-parallel steps: the experts get their own (train/experts.py)
        if getattr(ns, "float8", False) and not ns.optimize:  # after shard: float8 checks the shards' shapes
            for i in range(self.dims.layers):
                sch[f"{layers}.{i}"].float8(recipe="tensorwise")
        if ns.activation_checkpoint == "full" and not ns.optimize:  # optimize_model checkpoints the layers itself
            for i in range(self.dims.layers):
                sch[f"{layers}.{i}"].checkpoint()
        pipeline = None
        if self.pipelined:
            stages = ns.pp * ns.stages_per_rank
            for cut in stage_cuts(self.dims.layers, stages):
                sch[f"{layers}.{cut}"].cut_pipeline_stage()
            pipeline = {"schedule": ns.pp_schedule, "n_microbatches": ns.microbatches, "loss_fn": self._pipeline_loss}
        bf16 = ns.dtype == "bf16"
        if ns.dp * self.cp > 1:  # under cp, FSDP / DDP run on dp and cp flattened (see distributed.mesh)
            policy = "bf16" if bf16 else "fp32"
            if ns.reduce_dtype == "bf16":  # the bf16 gradients summed as they are, with no casts
                policy = {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}
            if ns.dp_mode in ("fsdp", "hsdp"):  # HSDP: fully_shard on the mesh's (dp_replicate, dp_shard)
                for i in range(self.dims.layers):
                    sch[f"{layers}.{i}"].fully_shard(mp_policy=policy,
                                                     reshard_after_forward=False if ns.no_reshard else None)
                sch.fully_shard(mp_policy=policy)
            else:
                sch.replicate(mp_policy=policy)
        self.fused_loss = False
        if ns.optimize:
            from ..models import optimize_model

            # selective checkpointing wraps the built layers, and must do so before they are compiled (recompute.py)
            optimize_model(sch, compile="layers" if ns.compile and ns.activation_checkpoint != "selective" else None,
                           selective_checkpoint="all" if ns.activation_checkpoint == "full" else None,
                           float8="tensorwise" if getattr(ns, "float8", False) else None)
            applied = sch.metadata["optimize"]["applied"]
            # the head hands its input to the fused loss when the model is called with labels (whole vocabulary)
            self.fused_loss = any(a.startswith("loss:") for a in applied)
            logger.info("rank %d: optimize_model: %s", self.rank, "; ".join(applied))
        # FSDP2 / DDP cast to bf16 themselves; otherwise autocast does (master weights stay fp32)
        self.autocast = bf16 and ns.dp == 1
        opt_cls, opt_kw = self._optimizer()
        torch.manual_seed(ns.seed)  # build initializes from the default generator: the same weights on every layout
        with self.materialize_mode:
            self.model, self.optimizer = schedlang.build(sch, optimizer=opt_cls, device=self.device,
                                                         pipeline=pipeline, pretrained=ns.init_from, **opt_kw)
        self.sch = sch
        if self.pipelined and self.cp == 1:
            # the first stage makes the positions (no --cp gives them): transformers' packed-sequence check, a host
            # sync per microbatch, has nothing to find
            from ..models.packed_sequences import skip_packed_sequence_check_in_stages

            skip_packed_sequence_check_in_stages(sch.mod, self._modules())
        self.grad_weight = self._tied_weights(tied) if self.pipelined and tied else {}
        weigh_expert_gradients(self)
        track_expert_load(self)
        if ns.activation_checkpoint == "selective":  # pp=1 (checked): the layers are the model's
            from .recompute import checkpoint_selectively

            for i, layer in enumerate(self.model.get_submodule(layers)):
                checkpoint_selectively(layer, where=f"{layers}.{i}")
        # optimize_model compiled the layers already, unless they are checkpointed selectively
        if ns.compile and (not ns.optimize or ns.activation_checkpoint == "selective"):
            for module in self._modules():
                if any(isinstance(m, torch.nn.ModuleList) for m in module.modules()):  # a stage may hold no layer
                    compile_layers(module)
            if ns.activation_checkpoint == "selective":
                from .recompute import trace_checkpoints_whole

                for layer in self.model.get_submodule(layers):
                    trace_checkpoints_whole(layer)
        logger.info("rank %d: built %s (%d parameters) as %s", self.rank, type(self.model).__name__, self.n_params,
                    self.layout())

    def _modules(self) -> List[torch.nn.Module]:
        stages = getattr(self.model, "stage_modules", None)  # a pipeline: the stages this rank holds
        return list(stages) if stages is not None else [self.model]

    def _tied_weights(self, tied: Dict[str, str]) -> Dict[int, float]:
        """A tied weight used by stages on several pp ranks has a copy on each (with the same summed gradient):
        per copy, the share that counts it once in the gradient norm."""
        import torch.distributed as dist

        mine: Dict[int, str] = {}
        for module in self._modules():
            for name, p in module.named_parameters(remove_duplicate=False):
                if name in tied:
                    mine[id(p)] = tied[name]
        everyone: List[Any] = [None] * self.world
        dist.all_gather_object(everyone, (self.pp_rank, sorted(set(mine.values()))))
        holders = {g: len({pp for pp, groups in everyone if g in groups}) for g in set(mine.values())}
        return {pid: 1.0 / holders[g] for pid, g in mine.items()}

    def _optimizer(self):
        ns = self.ns
        if ns.optimizer == "sgd":
            return torch.optim.SGD, {"lr": ns.lr, "momentum": 0.9, "weight_decay": ns.weight_decay}
        kw = {"lr": ns.lr, "betas": (0.9, 0.95), "weight_decay": ns.weight_decay}
        if ns.optimizer == "fused-adamw":
            return "adamw", kw
        return torch.optim.AdamW, kw

    # -- loss
    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean token cross entropy of this rank's rows; vocabulary-parallel when the logits stay split."""
        if self.ns.tp > 1 and logits.shape[-1] != self.dims.vocab:
            from ..distributed.cross_entropy import vocab_parallel_cross_entropy

            return vocab_parallel_cross_entropy(logits.flatten(0, -2), labels.flatten(), group=self.tp_group)
        return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())

    def _pipeline_loss(self, output, target):
        logits = output.logits if hasattr(output, "logits") else (output[0] if isinstance(output, (tuple, list))
                                                                 else output)
        return self._loss(logits, self._split_labels(target))

    def _split_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Under --cp, this rank's labels (aligned with the inputs, so split like them; see forward_loss)."""
        if self.cp == 1:
            return labels
        from ..distributed.context_parallel import split_sequence

        return split_sequence(labels, 1, self.cp, self.mesh.get_local_rank("cp"))

    # -- one step
    def step(self, step: int, tokens: torch.Tensor) -> Dict[str, Any]:
        """One step on this rank's rows of the global batch ``tokens``; see :meth:`train_step`."""
        rows = self.ns.global_batch // self.ns.dp
        local = tokens[self.dp_rank * rows:(self.dp_rank + 1) * rows]
        if self.device.type == "cuda":
            local = local.pin_memory()
        local = local.to(self.device, non_blocking=True)
        start_expert_load(self)
        out = self.train_step(step, local[:, :-1], local[:, 1:])
        out.update(expert_load(self))  # the step's expert load (--ep), over every expert of every block
        return out

    def forward_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean token loss of ``inputs`` against ``labels`` (aligned), through the run's model (pp=1)."""
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast)
        # the model keeps this rank's tokens of the inputs (--cp); the labels (aligned, so shifted on the full
        # sequence) follow the same split. Every cp rank holds as many tokens (no label is ignored), so its mean
        # averaged over cp, as the gradients are, is the mean over the whole sequence. Under a pipeline the
        # first stage splits the inputs and the loss function the labels, per microbatch
        labels = self._split_labels(labels)
        with autocast:  # with the fused loss the labels go in aligned with the inputs: no shift inside
            out = (self.model(input_ids=inputs, labels=labels, shift_labels=labels, use_cache=False)
                   if self.fused_loss else self.model(input_ids=inputs, use_cache=False))
        return out.loss if self.fused_loss else self._loss(out.logits, labels)

    def train_step(self, step: int, inputs: torch.Tensor, labels: torch.Tensor) -> Dict[str, Any]:
        """Forward, backward, clipping and the optimizer's step on this rank's rows. Nothing waits for the device:
        the loss and the gradient norm come back as device tensors (``float()`` them when needed), so the host
        queues the next step while this one runs."""
        ns = self.ns
        lr = lr_at(ns, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        torch.manual_seed(_mix(ns.seed, step, 2))  # dropout and any other draws: a function of the step
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast)
        if self.pipelined:
            losses: List[torch.Tensor] = []
            with autocast:
                self.model.step(inputs, target=labels, losses=losses)
            # the last stage holds one mean loss per microbatch (equal token counts): their mean is the rows' mean
            local_loss = torch.stack([l.detach().float() for l in losses]).mean() if losses else None
        else:
            local_loss = torch.zeros((), device=self.device)
            m = ns.microbatches
            for k, (x, y) in enumerate(zip(inputs.chunk(m), labels.chunk(m))):
                if ns.dp_mode == "hsdp" and m > 1:  # the replicas sum their gradient shards after the last only
                    self._all_reduce_replicas(k == m - 1)
                if ns.dp_mode == "ddp" and ns.dp > 1 and m > 1:  # the replicas sum the gradients after the last only
                    self._sync_gradients(k == m - 1)
                loss = self.forward_loss(x, y) / m
                loss.backward()
                local_loss += loss.detach().float()
        grad_norm = self._clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": self._global_loss(local_loss), "lr": lr, "grad_norm": grad_norm}

    def _sync_gradients(self, on: bool) -> None:
        """DDP under accumulation: the earlier microbatches' gradients stay local (summed into the unsharded
        gradients) and the last one's backward all-reduces the total once, as the step estimate counts it."""
        from ..distributed.data_parallel import set_gradient_sync

        set_gradient_sync(self.model, on)

    def _all_reduce_replicas(self, on: bool) -> None:
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.set_requires_all_reduce(on, recurse=False)

    def eval_loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """The mean token loss of a global batch of held-out ``tokens`` (no gradients, nothing updated)."""
        rows = self.ns.global_batch // self.ns.dp
        local = tokens[self.dp_rank * rows:(self.dp_rank + 1) * rows].to(self.device)
        inputs, labels = local[:, :-1], local[:, 1:]
        if self.pipelined:
            # a pipeline schedule runs forward and backward together: the gradients it leaves are dropped, and the
            # optimizer never sees them (the weights stay as they are)
            losses: List[torch.Tensor] = []
            autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast)
            with autocast:
                self.model.step(inputs, target=labels, losses=losses)
            self.optimizer.zero_grad(set_to_none=True)
            local_loss = torch.stack([l.detach().float() for l in losses]).mean() if losses else None
        else:
            modules = self._modules()
            for m in modules:  # dropout off while evaluating
                m.eval()
            try:
                with torch.no_grad():
                    local_loss = torch.stack([self.forward_loss(x, y).float()
                                              for x, y in zip(inputs.chunk(self.ns.microbatches),
                                                              labels.chunk(self.ns.microbatches))]).mean()
            finally:
                for m in modules:
                    m.train()
        return self._global_loss(local_loss)

    def _holds_loss(self) -> bool:
        return not self.pipelined or self.pp_rank == self.ns.pp - 1

    def _global_loss(self, local_loss: Optional[torch.Tensor]) -> torch.Tensor:
        """Mean over the global batch: every rank that holds a loss adds loss / (ranks holding one); a sum over all.
        A device tensor (the all-reduce is queued, not waited for)."""
        if self.world == 1:
            return local_loss
        import torch.distributed as dist

        # tp ranks hold the same value: each counted 1 / tp; cp ranks each the mean of their tokens
        holders = self.ns.dp * self.ns.tp * self.cp
        value = local_loss / holders if (local_loss is not None and self._holds_loss()) else None
        buf = value.reshape(1).to(self.device) if value is not None else torch.zeros(1, device=self.device)
        dist.all_reduce(buf)
        return buf[0]

    def _params(self) -> List[torch.nn.Parameter]:
        """Every trainable parameter of this rank once (two stages of one rank may share a tied weight); the
        modules do not change after build, so the list is made once."""
        cached = getattr(self, "_param_list", None)
        if cached is None:
            seen, cached = set(), []
            for m in self._modules():
                for p in m.parameters():
                    if p.requires_grad and id(p) not in seen:
                        seen.add(id(p))
                        cached.append(p)
            self._param_list = cached
        return cached

    def _clip(self) -> torch.Tensor:
        """Global gradient norm over every rank's shards (each distinct element counted once); clips to --grad-clip.

        The host work per step is one pass over the gradients: each gradient's share of the norm (how many
        ranks hold a piece of it) depends only on its placements, which do not change between steps, so the
        shares are worked out on the first step (and again only if the set of gradients changes)."""
        params = [p for p in self._params() if p.grad is not None]
        key = tuple(map(id, params))
        cached = getattr(self, "_clip_cache", None)
        if cached is None or cached[0] != key:
            cached = self._clip_cache = (key, self._clip_shares(params))
        local_grads = [_local(p.grad).detach() for p in params]
        # one multi-tensor pass for every gradient's norm (in fp32) rather than a few kernels per gradient
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        if local_grads:
            norms = torch.stack(torch._foreach_norm(local_grads, 2, dtype=torch.float32))
            total = (norms.square() * cached[1]).sum()
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(total)
        norm = total.sqrt()
        clip = self.ns.grad_clip
        if clip and local_grads:
            # on the device, as torch's clip_grad_norm_ does: no wait for the norm; a non-finite norm clips nothing
            scale = torch.clamp(clip / (norm + 1e-6), max=1.0)
            scale = torch.where(torch.isfinite(norm), scale, torch.ones_like(scale))
            torch._foreach_mul_(local_grads, scale.to(local_grads[0].device))
        return norm

    def _clip_shares(self, params: List[torch.nn.Parameter]) -> torch.Tensor:
        """Each gradient's weight in the squared global norm, as a device tensor: a gradient sharded over n ranks
        is a piece (weight n / ranks of a stage, summed back to 1 over its pieces), a replicated one a copy."""
        per_stage = self.world // self.ns.pp  # ranks of one pipeline stage each hold a piece or a copy
        shares = []
        for p in params:
            g = p.grad
            pieces = self.grad_weight.get(id(p), 1.0)
            if DTensor is not None and isinstance(g, DTensor):
                for dim, placement in enumerate(g.placements):
                    if placement.is_partial():  # pragma: no cover - gradients are reduced by now
                        raise TrainError(f"train: gradient of shape {tuple(g.shape)} is still a partial sum; "
                                         "gradients must be reduced before clipping")
                    if not placement.is_replicate():  # Shard, and FSDP2's strided shards of TP shards
                        pieces *= g.device_mesh.size(dim)
            shares.append(pieces / per_stage)
        return torch.tensor(shares, dtype=torch.float32, device=self.device)

    # -- checkpoints
    def save(self, step: int) -> Path:
        from .resume import save_step

        ns = self.ns
        extra = {"seed": ns.seed, "data": ns.data, "global_batch": ns.global_batch, "seq": ns.seq,
                 "steps": ns.steps, "model": ns.model, "config": ns.config, "dims": dataclasses.asdict(self.dims),
                 "layout": self.layout()}
        return save_step(self, step, extra)

    def load(self):
        """The newest complete checkpoint loaded (``resume.Resumed``: its step, 0 when there was none)."""
        from .resume import load_newest

        return load_newest(self)

    def export(self, directory: str) -> None:
        import copy

        import schedlang

        # the run's own config: a pipelined model has none to read (its stages are parts of the model), and the
        # exported model is used for inference, where the cache that training turned off belongs
        config = copy.deepcopy(self.cfg)
        config.use_cache = True
        if not getattr(config, "architectures", None):
            config.architectures = [_model_class(config).__name__]
        schedlang.export_hf(self.model, directory, config=config)
        self._barrier()

    def _barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a gradient, sharing its storage (scaling it scales the gradient). A DTensor's local
    tensor is read directly: ``to_local()`` is an autograd function call, a few tens of microseconds for each of
    a model's hundreds of gradients every step, and gradients need no autograd."""
    if DTensor is not None and isinstance(grad, DTensor):
        return grad._local_tensor
    return grad
