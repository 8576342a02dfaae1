"""The models and the PyTorch-only baselines of the training benchmarks (``bench/bench_train.py``).

The baselines are PyTorch's own tools applied as the reference scripts apply them (their plans and
settings, rewritten here so that the benchmark runs without them):

* ``eager``: the plain model, bf16 autocast over fp32 weights;
* ``compile``: ``torch.compile`` of the whole model;
* ``titan-style``: each decoder block compiled on its own (torchtitan's choice); on 1 GPU the model
  stays plain (no DTensor), which is the faster 1-GPU reference;
* ``titan-style-fp8``: the same after torchao's ``convert_to_float8_training`` of the blocks'
  Linears (tensorwise scaling, the faster recipe on H100/H200);
* ``dtensor-compile``: the simple tensor-parallel plan (``parallelize_module`` with Colwise
  q/k/v/gate/up and Rowwise o/down; embedding and LM head replicated) + whole-model compile;
* ``tp-titan``: vocabulary-parallel embedding (Rowwise, output replicated), Colwise LM head with the
  logits left sharded on the vocabulary and the loss under ``loss_parallel``, per-block compile;
* ``fsdp2-titan``: ``fully_shard`` on every (compiled) block then the root, bf16 parameters for
  compute with fp32 gradient reduction (``MixedPrecisionPolicy``); ``fsdp2-titan-noreshard`` keeps each
  block's gathered weights from its forward to its backward, and ``-noreshard-bf16reduce`` also
  reduce-scatters the gradients in bf16 (torchtitan's ``mixed_precision_reduce="bfloat16"``);
* ``fsdp2-titan-fp8``: the same over float8 blocks whose weights FSDP2 all-gathers in float8, with
  torchao's ``precompute_float8_dynamic_scale_for_fsdp`` after every optimizer step (torchtitan's
  float8 settings);
* ``tp-fsdp-titan``: ``tp-titan``'s plan on ``tp``, then FSDP2 on ``dp``;
* ``ddp-titan``: torch's ``DistributedDataParallel`` over the model whose blocks are compiled one by
  one, bf16 autocast over fp32 weights, gradients all-reduced in fp32 buckets of 100 MB (torchtitan's
  DDP bucket size) that are the gradients' storage (``gradient_as_bucket_view``);
* ``ddp-titan-fp8``: the same over torchao's float8 blocks (``titan-style-fp8``'s conversion).

Every one takes the loss the same way: the body's last hidden state, the LM head, then
``F.cross_entropy`` of fp32 logits against labels shifted on the host (logits never sliced), and
uses the run's optimizer (:meth:`Context.optimizer`: ``torch.optim.AdamW(fused=True)`` by default,
or ``schedlang.optim.FusedAdamW`` on both sides), with ``use_cache=False``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

LR = 1e-4
OPTIMIZERS = {"torch-fused": "torch.optim.AdamW(fused=True)", "schedlang-fused": "schedlang.optim.FusedAdamW"}


class NotAvailable(RuntimeError):
    """Something a variant needs is not installed or not there (yet): the row says what."""


# --------------------------------------------------------------------------------------------- models
def model_config(family: str, shape: str, tiny: bool, layers: int = 8, seq: int = 2048):
    """The HF config of a work's model; ``tiny``: 2 layers of small widths, for the CPU."""
    if family == "gpt2":
        from transformers import GPT2Config

        dims = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64) if tiny else dict(
            n_layer=24, n_embd=1024, n_head=16, vocab_size=50304, n_positions=1024)
        cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **dims)
    else:
        from transformers import LlamaConfig

        if tiny:
            kv = 2 if shape == "llama-8b" else 4
            dims = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=kv,
                        intermediate_size=160, vocab_size=256, max_position_embeddings=64)
        elif shape == "llama-8b":
            dims = dict(num_hidden_layers=layers, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                        intermediate_size=14336, vocab_size=128256, max_position_embeddings=max(8192, seq))
        else:
            dims = dict(num_hidden_layers=22, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
                        intermediate_size=5632, vocab_size=32000, max_position_embeddings=2048)
        cfg = LlamaConfig(**dims)
    cfg._attn_implementation = "sdpa"
    return cfg


def full_model(cfg, device):
    """The unsharded model with HF's initialization from seed 0 on ``device`` (the same weights every call)."""
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return (GPT2LMHeadModel if cfg.model_type == "gpt2" else LlamaForCausalLM)(cfg)


def body(model):
    """The model without its LM head (``model.model`` / ``model.transformer``)."""
    return model.transformer if hasattr(model, "transformer") else model.model


def blocks(model):
    """The ModuleList of decoder blocks."""
    b = body(model)
    return b.h if hasattr(b, "h") else b.layers


def layer_paths(model) -> List[str]:
    prefix = "transformer.h" if hasattr(model, "transformer") else "model.layers"
    return [f"{prefix}.{i}" for i in range(len(blocks(model)))]


def plain_loss(logits, labels):
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)


# ------------------------------------------------------------------------------------------- a variant
@dataclass
class Setup:
    """A built variant: its model and optimizer, how a step computes the loss, and which rows it trains on."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, labels) -> scalar loss
    dp: int = 1
    tp: int = 1
    dp_rank: int = 0
    notes: Dict[str, Any] = field(default_factory=dict)  # "loss": how the loss is taken, and more
    # a whole training step ``step(ids, labels) -> loss`` (optimizer step included), used after the first step in
    # place of loss_fn, backward and the optimizer's step (a step replayed from a CUDA graph)
    step: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None

    def backward(self, loss):
        loss.backward()


class Context:
    """What every variant of one run shares: device, world, precision, optimizer, meshes (made once)."""

    def __init__(self, args, device, world):
        self.args, self.device, self.world = args, device, world
        self.lr = getattr(args, "lr", None) or LR
        self.cuda = device.type == "cuda"
        self.bf16 = self.cuda  # --tiny runs in fp32 on the CPU
        self._meshes: Dict[Any, Any] = {}

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()

    def mp_policy(self, reduce_dtype: torch.dtype = torch.float32):
        """FSDP2's mixed precision: bf16 parameters for compute and ``reduce_dtype`` gradient reduction (fp32,
        torchtitan's default) in a bf16 run; plain fp32 otherwise."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.bf16:
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        return MixedPrecisionPolicy()

    def optimizer(self, params_or_groups) -> torch.optim.Optimizer:
        """The run's AdamW (lr ``--lr``, 1e-4 by default; weight decay 0.01), the same class and kind for every
        variant."""
        if self.args.optimizer == "schedlang-fused":
            from schedlang.optim import FusedAdamW

            params = [p for g in params_or_groups for p in (g["params"] if isinstance(g, dict) else [g])]
            return FusedAdamW(params, lr=self.lr, weight_decay=0.01)
        # torch's fused AdamW on GPUs; on the CPU (--tiny) its foreach twin, which takes DTensors on gloo
        kind = {"fused": True} if self.cuda else {"foreach": True}
        return torch.optim.AdamW(params_or_groups, lr=self.lr, weight_decay=0.01, **kind)

    def optimizer_name(self) -> str:
        """What :meth:`optimizer` makes, as the rows record it."""
        if self.args.optimizer == "torch-fused" and not self.cuda:
            return "torch.optim.AdamW(foreach=True)"
        return OPTIMIZERS[self.args.optimizer]

    def mesh(self, dp: int, tp: int):
        """A ("dp", "tp") DeviceMesh made with torch alone, for the baselines."""
        key = ("torch", dp, tp)
        if key not in self._meshes:
            from torch.distributed.device_mesh import init_device_mesh

            self._meshes[key] = init_device_mesh(self.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        return self._meshes[key]

    def compile_block(self, block):
        return torch.compile(block) if self.args.compile else block


def adamw_groups(model):
    """One group for DTensor parameters and one for plain ones (torch's fused kernel takes them apart)."""
    from torch.distributed.tensor import DTensor

    dparams = [p for p in model.parameters() if isinstance(p, DTensor)]
    pparams = [p for p in model.parameters() if not isinstance(p, DTensor)]
    return [{"params": g} for g in (dparams, pparams) if g]


def _head_loss(ctx: Context, fwd_body, head):
    def loss_fn(ids, labels):
        with ctx.autocast():
            logits = head(fwd_body(input_ids=ids, use_cache=False).last_hidden_state)
        return plain_loss(logits, labels)

    return loss_fn


# ------------------------------------------------------------------------------------------- 1 process
def make_eager(ctx: Context, cfg, compile_model: bool = False) -> Setup:
    model = full_model(cfg, ctx.device)
    opt = ctx.optimizer(model.parameters())
    fwd = torch.compile(model) if compile_model and ctx.args.compile else model

    def loss_fn(ids, labels):
        with ctx.autocast():
            logits = fwd(input_ids=ids, use_cache=False).logits
        return plain_loss(logits, labels)

    return Setup(model, opt, loss_fn, notes={"loss": "logits -> F.cross_entropy (fp32)",
                                             "compile": "model" if compile_model and ctx.args.compile else None})


def convert_blocks_to_float8(model, recipe: str, fsdp_all_gather: bool = False) -> None:
    """torchao's float8 training for every Linear of the blocks (the LM head stays), as torchtitan converts
    them; emulated where there are no float8 tensor cores (the CPU ``--tiny`` run)."""
    import dataclasses

    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise NotAvailable(f"torchao is not installed ({e}); install it to run the float8 work") from e
    float8_cores = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=not float8_cores,
                                 enable_fsdp_float8_all_gather=fsdp_all_gather)
    convert_to_float8_training(blocks(model), config=config,
                               module_filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear))


def make_titan_style(ctx: Context, cfg, fp8: str = None) -> Setup:
    model = full_model(cfg, ctx.device)
    if fp8:
        convert_blocks_to_float8(model, fp8)
    layers = blocks(model)
    for i, block in enumerate(layers):
        layers[i] = ctx.compile_block(block)
    opt = ctx.optimizer(model.parameters())
    return Setup(model, opt, _head_loss(ctx, body(model), model.lm_head),
                 notes={"loss": "body -> lm_head -> F.cross_entropy (fp32)", "compile": "blocks", "float8": fp8})


# ------------------------------------------------------------------------------------------ tensor parallel
def simple_tp_plan(cfg) -> Dict[str, Any]:
    """``tp_baseline.py``'s plan: attention and MLP only (embedding and LM head replicated)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{p}.{n}"] = ColwiseParallel()
        plan[f"{p}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"{p}.mlp.down_proj"] = RowwiseParallel()
    return plan


def titan_tp_plan(cfg) -> Dict[str, Any]:
    """``tp_titan.py``'s plan: the simple plan plus a vocabulary-parallel embedding and an LM head whose logits
    stay sharded on the vocabulary (a DTensor, for ``loss_parallel``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = simple_tp_plan(cfg)
    plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    plan["lm_head"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)
    return plan


def make_dtensor_compile(ctx: Context, cfg) -> Setup:
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = ctx.mesh(1, ctx.world)
    model = full_model(cfg, ctx.device)
    parallelize_module(model, mesh["tp"], simple_tp_plan(cfg))
    opt = ctx.optimizer(adamw_groups(model))
    fwd = torch.compile(model) if ctx.args.compile else model

    def loss_fn(ids, labels):
        with ctx.autocast():
            logits = fwd(input_ids=ids, use_cache=False).logits
        return plain_loss(logits, labels)

    return Setup(model, opt, loss_fn, tp=ctx.world, notes={"loss": "replicated logits -> F.cross_entropy (fp32)",
                                                           "compile": "model"})


def make_tp_titan(ctx: Context, cfg, dp: int = 1, fsdp: bool = False) -> Setup:
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    tp = ctx.world // dp
    mesh = ctx.mesh(dp, tp)
    model = full_model(cfg, ctx.device)
    if tp > 1:
        parallelize_module(model, mesh["tp"], titan_tp_plan(cfg))
    layers = blocks(model)
    for i, block in enumerate(layers):
        layers[i] = ctx.compile_block(block)
    if fsdp:  # FSDP2 on the data dimension over the tensor-parallel DTensors; it casts to bf16 itself
        from torch.distributed.fsdp import fully_shard

        mp = ctx.mp_policy()
        for block in layers:
            fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
        fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    opt = ctx.optimizer(adamw_groups(model))
    amp = contextlib.nullcontext if fsdp else ctx.autocast
    parallel_loss = loss_parallel if tp > 1 else contextlib.nullcontext

    class _Setup(Setup):
        def backward(self, loss):  # the loss's backward runs under loss_parallel too
            with parallel_loss():
                loss.backward()

    def loss_fn(ids, labels):
        with amp():
            if fsdp:  # through the root, whose FSDP2 hooks gather the embedding, final norm and head
                logits = model(input_ids=ids, use_cache=False).logits
            else:
                logits = model.lm_head(model.model(input_ids=ids, use_cache=False).last_hidden_state)
        with parallel_loss():
            return plain_loss(logits, labels)

    return _Setup(model, opt, loss_fn, dp=dp, tp=tp, dp_rank=mesh.get_local_rank("dp"),
                  notes={"loss": "vocab-sharded logits -> loss_parallel F.cross_entropy (fp32)", "compile": "blocks"})


def reduce_dtype_name(mp) -> str:
    """The dtype FSDP2 reduces gradients in under ``mp`` (the parameters' own when the policy names none)."""
    return str(mp.reduce_dtype).replace("torch.", "") if mp.reduce_dtype is not None else "the parameters' dtype"


def make_fsdp2_titan(ctx: Context, cfg, fp8: str = None, reshard: bool = True,
                     reduce_dtype: torch.dtype = torch.float32) -> Setup:
    """FSDP2 per block and at the root with bf16 mixed precision, blocks compiled one by one, as torchtitan
    applies it. ``reshard=False`` is torchtitan's ``reshard_after_forward_policy="never"``: each block keeps
    its gathered weights from its forward to its backward (one all-gather per block and step, not two).
    ``reduce_dtype=torch.bfloat16`` is torchtitan's ``mixed_precision_reduce="bfloat16"``: gradients
    reduce-scattered in bf16 (half the bytes of the default fp32)."""
    from torch.distributed.fsdp import fully_shard

    mesh = ctx.mesh(ctx.world, 1)["dp"]
    model = full_model(cfg, ctx.device)
    if fp8:  # torchtitan's float8 with FSDP2: weights all-gathered in float8
        convert_blocks_to_float8(model, fp8, fsdp_all_gather=True)
    mp = ctx.mp_policy(reduce_dtype)
    layers = blocks(model)
    for i, block in enumerate(layers):
        block = ctx.compile_block(block)
        layers[i] = block
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp)  # the root keeps torch's default: not resharded after forward
    opt = ctx.optimizer(model.parameters())
    if fp8:  # and, as torchtitan does, every weight's float8 scale from one all-reduce after each step
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        opt.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))

    def loss_fn(ids, labels):
        return plain_loss(model(input_ids=ids, use_cache=False).logits, labels)

    return Setup(model, opt, loss_fn, dp=ctx.world, dp_rank=mesh.get_local_rank(),
                 notes={"loss": "logits -> F.cross_entropy (fp32)", "compile": "blocks",
                        "float8": f"{fp8}, float8 all-gather" if fp8 else None,
                        "reshard_after_forward": reshard, "reduce_dtype": reduce_dtype_name(mp)})


def make_ddp_titan(ctx: Context, cfg, fp8: str = None) -> Setup:
    """DDP over the model whose blocks are compiled one by one; ``fp8``: torchao's float8 Linears in the blocks
    first (each rank holds every weight, so there is no float8 all-gather and no scale to precompute)."""
    from torch.nn.parallel import DistributedDataParallel

    mesh = ctx.mesh(ctx.world, 1)["dp"]
    model = full_model(cfg, ctx.device)
    if fp8:
        convert_blocks_to_float8(model, fp8)
    layers = blocks(model)
    for i, block in enumerate(layers):
        layers[i] = ctx.compile_block(block)
    ddp = DistributedDataParallel(model, device_ids=[ctx.device] if ctx.cuda else None, process_group=mesh.get_group(),
                                  bucket_cap_mb=100, gradient_as_bucket_view=True)
    opt = ctx.optimizer(model.parameters())

    def loss_fn(ids, labels):
        with ctx.autocast():  # through DDP's forward, which readies the gradient all-reduce of this backward
            logits = ddp(input_ids=ids, use_cache=False).logits
        return plain_loss(logits, labels)

    return Setup(model, opt, loss_fn, dp=ctx.world, dp_rank=mesh.get_local_rank(),
                 notes={"loss": "logits -> F.cross_entropy (fp32)", "compile": "blocks", "float8": fp8})


#: variant name -> builder(ctx, cfg)
BASELINES: Dict[str, Callable[[Context, Any], Setup]] = {
    "eager": lambda ctx, cfg: make_eager(ctx, cfg),
    "compile": lambda ctx, cfg: make_eager(ctx, cfg, compile_model=True),
    "titan-style": lambda ctx, cfg: make_titan_style(ctx, cfg),
    "titan-style-fp8": lambda ctx, cfg: make_titan_style(ctx, cfg, fp8="tensorwise"),
    "dtensor-compile": make_dtensor_compile,
    "tp-titan": lambda ctx, cfg: make_tp_titan(ctx, cfg),
    "tp-fsdp-titan": lambda ctx, cfg: make_tp_titan(ctx, cfg, dp=ctx.world // ctx.args.tp2d, fsdp=True),
    "fsdp2-titan": make_fsdp2_titan,
    "fsdp2-titan-fp8": lambda ctx, cfg: make_fsdp2_titan(ctx, cfg, fp8="tensorwise"),
    "fsdp2-titan-noreshard": lambda ctx, cfg: make_fsdp2_titan(ctx, cfg, reshard=False),
    "fsdp2-titan-noreshard-bf16reduce": lambda ctx, cfg: make_fsdp2_titan(ctx, cfg, reshard=False,
                                                                          reduce_dtype=torch.bfloat16),
    "ddp-titan": make_ddp_titan,
    "ddp-titan-fp8": lambda ctx, cfg: make_ddp_titan(ctx, cfg, fp8="tensorwise"),
}
