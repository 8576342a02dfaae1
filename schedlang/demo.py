"""The demo behind ``schedlang demo``: a tiny LLaMA (built from a transformers config, nothing is
downloaded) scheduled for training, verified against the original, and timed against it.

The schedule, shown as a printed plan:

* tensor parallelism over the local ranks (``schedlang.models.shard_model``): attention heads,
  MLP and vocabulary split Megatron-style;
* in every MLP, the SwiGLU (``silu(gate) * up``) found in the model's own code, traced and fused
  into one generated kernel (Triton on a GPU; TorchInductor on a CPU, where Triton does not run);
* activation checkpointing only where memory matters: when the activations of a step would
  take more than half of the memory available, every layer recomputes its own in backward.

After ``build``, every decoder layer's forward is compiled (``compile_layers``). The closing
table compares one training step of the original model, run as a user would (one process, all
cores or one GPU), with the scheduled one over all ranks, on the same global batch: tokens per
second of the whole job, and memory per rank.

Example::

    from schedlang.demo import run_demo
    print(run_demo(world_size=2, device="cpu"))
"""

from __future__ import annotations

import os
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

__all__ = ["DemoOptions", "demo_config", "demo_model", "demo_batch", "schedule_demo", "run_demo"]


class DemoOptions(dict):
    """The demo's sizes and settings (a dict, so it crosses to spawned ranks as it is)."""

    DEFAULTS = dict(layers=4, hidden=256, heads=8, kv_heads=4, intermediate=688, vocab=4096, batch=8, seq=256,
                    repeats=5, device="cpu", compile=True, report=None, report_single=None)

    def __init__(self, **kwargs):
        unknown = set(kwargs) - set(self.DEFAULTS)
        if unknown:
            raise TypeError(f"unknown demo options {sorted(unknown)}; valid: {sorted(self.DEFAULTS)}")
        super().__init__({**self.DEFAULTS, **kwargs})


def demo_config(opts: Dict):
    """The tiny LLaMA's transformers config."""
    try:
        from transformers import LlamaConfig
    except ImportError as e:
        from .errors import ScheduleValueError

        raise ScheduleValueError("demo: the demo builds a HuggingFace LLaMA and needs transformers: "
                                 "pip install 'schedlang[hf]'") from e

    return LlamaConfig(hidden_size=opts["hidden"], intermediate_size=opts["intermediate"],
                       num_hidden_layers=opts["layers"], num_attention_heads=opts["heads"],
                       num_key_value_heads=opts["kv_heads"], vocab_size=opts["vocab"],
                       max_position_embeddings=max(512, opts["seq"]), use_cache=False, attn_implementation="sdpa")


def demo_model(opts: Dict, device: torch.device):
    """The model, with the same weights on every rank (seeded)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(demo_config(opts)).to(device)


def demo_batch(opts: Dict, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, opts["vocab"], (opts["batch"], opts["seq"]), generator=generator).to(device)


def activation_bytes(opts: Dict, world: int) -> int:
    """Activations one training step keeps for backward, per rank (the usual per-layer estimate for
    a transformer in fp32: about 34 h + 5 heads s values per token, split over tensor-parallel ranks)."""
    tokens = opts["batch"] * opts["seq"]
    per_layer = tokens * (34 * opts["hidden"] + 5 * opts["heads"] * opts["seq"]) * 4
    return opts["layers"] * per_layer // max(1, world) + tokens * opts["vocab"] * 4 * 2


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    return 8 * 2**30


def _swiglu(gate, up):
    return F.silu(gate) * up


def schedule_demo(model, ids: torch.Tensor, opts: Dict, world: int):
    """The demo's schedule of ``model`` over ``world`` ranks, inside ``Verify``; returns
    ``(sch, verify, notes)``."""
    import schedlang
    from schedlang.models import shard_model

    device = ids.device
    compiler = "triton" if device.type == "cuda" else "inductor"
    notes: List[str] = []
    sch = schedlang.create_schedule(model)
    with schedlang.Verify(sch, example_inputs=[ids]) as check:
        if world > 1:
            shard_model(sch, gather_logits=True)  # full logits: the HF loss (labels=) runs as it is
            notes.append(f"tensor parallel over {world} ranks: {opts['heads'] // world} attention heads and "
                         f"1/{world} of the MLP and vocabulary per rank")
        for i in range(opts["layers"]):
            mlp = sch[f"model.layers.{i}.mlp"]
            mlp.trace(flatten=True)
            mlp.fuse(mlp.find(_swiglu), compiler=compiler, name="SwiGLU")
        notes.append(f"SwiGLU (silu(gate) * up) fused into one {compiler} kernel in each of the {opts['layers']} MLPs")
        need, have = activation_bytes(opts, world), available_bytes(device)
        if need > have // 2:
            for i in range(opts["layers"]):
                sch[f"model.layers.{i}"].checkpoint()
            notes.append(f"activation checkpointing on every layer: a step keeps ~{need / 2**20:,.0f} MiB of "
                         f"activations, more than half of the {have / 2**20:,.0f} MiB available")
        else:
            notes.append(f"no activation checkpointing: a step keeps ~{need / 2**20:,.0f} MiB of activations "
                         f"and {have / 2**20:,.0f} MiB are available, so recomputing would only cost time")
    return sch, check, notes


def _train_step(model, ids):
    def step():
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        for p in model.parameters():
            p.grad = None
        return out.loss

    return step


def _step_times_ms(step, device, repeats: int) -> List[float]:
    """The time of each of ``repeats`` steps (ms), after two untimed ones."""
    step()
    step()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _median(times: List[float]) -> float:
    return sorted(times)[len(times) // 2]


MIN_STEPS_FOR_SPREAD = 3  # below this the timed steps say nothing about the noise


def within_noise(times: List[float], original: List[float]) -> Optional[bool]:
    """Whether ``times`` and the original's step times overlap (min to max of each): a difference of
    medians inside that is no measured difference. None when too few steps were timed to tell."""
    if min(len(times), len(original)) < MIN_STEPS_FOR_SPREAD:
        return None
    return min(times) <= max(original) and min(original) <= max(times)


def speed_table(rows: List[tuple], tokens: int) -> List[str]:
    """The closing table: one row per ``(name, step times in ms, parameters per rank, peak MiB or None)``,
    the first row the original. Step ms is the median; spread its fastest and slowest step; speed the
    original's median over the row's, marked ``~`` when the spreads overlap (within noise)."""
    original = rows[0][1]
    show_peak = any(peak is not None for *_, peak in rows)
    header = f"{'':<44}{'step ms':>9}{'spread (min-max)':>19}{'tokens/s':>11}{'speed':>9}{'params/rank':>13}"
    lines = [header + (f"{'peak MiB':>10}" if show_peak else "")]
    for name, times, params, peak in rows:
        ms = _median(times)
        spread = f"{min(times):.1f}-{max(times):.1f}" if len(times) >= MIN_STEPS_FOR_SPREAD else "n/a"
        noise = "~" if times is not original and within_noise(times, original) else " "
        line = f"{name:<44}{ms:>9.1f}{spread:>19}{tokens / ms * 1e3:>11,.0f}{noise:>2}{_median(original) / ms:.2f}x"
        line = f"{line}{params:>13,}"
        lines.append(line + (f"{peak:>10,.0f}" if peak is not None else ""))
    return lines


def speed_verdict(rows: List[tuple], device: str) -> str:
    """What the table measured, in words that agree with it: each schedule against the original, faster,
    slower or within noise; and, for ranks on one CPU, what such a comparison does and does not show."""
    original = rows[0][1]
    counted = len(original)
    if counted < MIN_STEPS_FOR_SPREAD:
        return (f"Only {counted} step{'s' if counted != 1 else ''} of each model timed: too few to tell a difference "
                f"from noise (run with --repeats {MIN_STEPS_FOR_SPREAD} or more).")
    parts = []
    for name, times, *_ in rows[1:]:
        ratio = _median(original) / _median(times)
        if within_noise(times, original):
            parts.append(f"{name}: {ratio:.2f}x, within noise (its steps and the original's overlap)")
        elif ratio > 1:
            parts.append(f"{name}: {ratio:.2f}x, faster (its slowest timed step beat the original's fastest)")
        else:
            parts.append(f"{name}: {ratio:.2f}x, slower (its fastest timed step was slower than the original's "
                         "slowest)")
    text = f"Against the original's {counted} timed steps: " + "; ".join(parts) + "."
    if device == "cpu" and any("ranks" in name for name, *_ in rows[1:]):
        text += ("\nThe ranks share this CPU's cores, so the tensor-parallel row compares two ways of using the same "
                 "cores (processes that each run 1/N of every layer, against one process running all of it), not "
                 "more hardware; across GPUs each rank brings its own, and splitting is what lets a model too large "
                 "for one device run.")
    return text


def _peak_mib(device) -> Optional[float]:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def _describe_schedule(sch, check, notes, seconds: float) -> List[str]:
    lines = [f"\n== The schedule ({seconds:.1f} s to write and verify) ==", str(sch.plan), ""]
    lines += [f"* {n}" for n in notes]
    from .lowering.fused_module import FusedSubgraph

    for path, module in sch.mod.named_modules():
        if isinstance(module, FusedSubgraph):
            # the generated source keeps blank lines between its functions; printed here they only take room
            source = [line for line in module.source.splitlines() if line.strip()]
            lines.append(f"* the fused kernel '{module.name}' at {path} ({module.compiler}; `schedlang report` shows "
                         f"all of it):")
            lines += ["    " + line for line in source[:10]] + (["    ..."] if len(source) > 10 else [])
            break
    lines += ["\n== Verify: forward and backward against the original model ==", str(check.report)]
    return lines


def _scheduled_run(rank: int, world: int, opts: Dict) -> Dict:
    """Schedule, verify, build, compile and time the model on this rank (one of ``world``)."""
    import schedlang
    from schedlang.models import compile_layers

    device = torch.device("cuda", rank) if opts["device"] == "cuda" else torch.device("cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    model = demo_model(opts, device)
    ids = demo_batch(opts, device)
    started = time.perf_counter()
    sch, check, notes = schedule_demo(model, ids, opts, world)
    lines = _describe_schedule(sch, check, notes, time.perf_counter() - started)
    started = time.perf_counter()
    scheduled, _ = schedlang.build(sch)
    if opts["compile"]:
        compile_layers(scheduled)
    scheduled.train()
    step = _train_step(scheduled, ids)
    step()  # compiles
    build_s = time.perf_counter() - started
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = _step_times_ms(step, device, opts["repeats"])
    if opts.get("report") and world > 1 or opts.get("report_single") and world == 1:
        sch.report(opts.get("report") or opts.get("report_single"), model=scheduled, verify=check,
                   title=f"schedlang demo: tiny LLaMA on {world} rank{'s' if world > 1 else ''}")
    return {"lines": lines, "times": times, "build_s": build_s, "peak": _peak_mib(device),
            "params": sum(getattr(p, "_local_tensor", p).numel() for p in scheduled.parameters())}


def _tp_rank(rank: int, world: int, opts: Dict) -> Optional[Dict]:
    from .quiet_imports import quiet_torchao_import

    quiet_torchao_import()  # a spawned rank imports transformers, and with it torchao, afresh
    result = _scheduled_run(rank, world, opts)
    return result if rank == 0 else None


def run_demo(world_size: int = 2, device: str = "cpu", progress: Optional[Callable[[str], None]] = None,
             **options) -> str:
    """Run the demo and return its text: the original model and its one-process schedule here, then
    (``world_size`` > 1) the tensor-parallel schedule over that many local ranks. ``progress``, if given,
    is called with a line saying what runs next (the whole demo takes minutes on a CPU)."""
    import schedlang

    say = progress or (lambda line: None)
    opts = DemoOptions(device=device, **options)
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    cores = os.cpu_count() or 1
    model = demo_model(opts, dev)
    ids = demo_batch(opts, dev)
    out: List[str] = []
    layout = f"then {world_size} local ranks ({'nccl' if device == 'cuda' else 'gloo'})" if world_size > 1 else ""
    out.append(f"schedlang {schedlang.__version__} demo: torch {torch.__version__}, {device}, one process {layout}")
    out.append(f"\n== The model: an unchanged HuggingFace LLaMA ({opts['layers']} layers, hidden {opts['hidden']}, "
               f"{opts['heads']} heads, vocabulary {opts['vocab']}; {sum(p.numel() for p in model.parameters()):,} "
               "parameters), built from a config")

    # the original, as a user runs it: one process with every core (or one GPU)
    say(f"timing {opts['repeats']} training steps of the original model")
    torch.set_num_threads(cores)
    model.train()
    eager_times = _step_times_ms(_train_step(model, ids), dev, opts["repeats"])
    eager_peak = _peak_mib(dev)
    params_full = sum(p.numel() for p in model.parameters())
    del model

    single_opts = DemoOptions(**{**opts, "report": None})
    single_opts["report_single"] = opts["report"] if world_size == 1 else None
    say("scheduling, verifying, building" + (" and compiling" if opts["compile"] else "") + " it in one process, "
        "then timing it")
    single = _scheduled_run(0, 1, single_opts)
    rows = [(f"original (1 process, {cores if device == 'cpu' else 1} {'cores' if device == 'cpu' else 'GPU'})",
             eager_times, params_full, eager_peak),
            ("schedlang, 1 process", single["times"], single["params"], single["peak"])]
    shown = single
    if world_size > 1:
        from .distributed.launch import run_distributed

        say(f"the same, tensor parallel over {world_size} local ranks "
            f"({'nccl' if device == 'cuda' else 'gloo'})")
        tp = run_distributed(_tp_rank, world_size=world_size, args=(opts,),
                             backend="nccl" if device == "cuda" else "gloo", timeout=600)[0]
        rows.append((f"schedlang, tensor parallel over {world_size} ranks", tp["times"], tp["params"], tp["peak"]))
        shown = tp
    out += shown["lines"]
    tokens = opts["batch"] * opts["seq"]
    out.append(f"\n== One training step, batch {opts['batch']} x {opts['seq']} tokens (build and compile took "
               f"{shown['build_s']:.1f} s) ==")
    out += speed_table(rows, tokens)
    out.append("(~: within noise, the row's timed steps overlap the original's; spread: fastest and slowest timed step)")
    out.append("\n" + speed_verdict(rows, device))
    out.append("\nWhat to try next:\n"
               "  schedlang train --model llama --config tiny --nproc 2 --tp 2 --steps 20   (train on any layout)\n"
               "  schedlang report --out report.html                                      (this schedule, as a page)\n"
               "  the tutorials in tutorials/ (python tutorials/01_quickstart.py), rendered by\n"
               "    python -m sphinx -W -b html docs docs/_build")
    return "\n".join(out)
