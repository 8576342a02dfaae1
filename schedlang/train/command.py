"""The command line: checks before any rank starts, then a single process, ``--nproc`` local
ranks or this rank of a ``torchrun`` launch; failures read as one line per failed rank."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import re
import sys
import traceback
from typing import Any, Dict, Optional, Sequence

import torch

from ..errors import DistributedError, SchedlangError
from .allocator import ALLOCATOR_VARIABLES, EXPANDABLE_SEGMENTS
from .checkpoints import _CKPT_PREFIX, latest_checkpoint, read_trainer_state
from .data import open_data
from .flags import _device_type, _fail, _world_from_env, build_parser, validate
from .layout import apply_layout, check_model_layout, choice_block, choose, hardware, model_facts, plan_block
from .loop import train
from ..quiet_imports import quiet_torchao_import

logger = logging.getLogger("schedlang.train")


def _rank_main(rank: int, world: int, options: Dict[str, Any]):
    """Entry point of a rank spawned by ``--nproc`` (process group set up by ``run_distributed``)."""
    logging.basicConfig(level=options.pop("_log_level", logging.WARNING), format="%(name)s: %(message)s")
    quiet_torchao_import()
    return train(argparse.Namespace(**options), rank, world)


def _torchrun_main(ns: argparse.Namespace, world: int) -> int:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    backend = "nccl" if _device_type(ns) == "cuda" else "gloo"
    if _device_type(ns) == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = datetime.timedelta(seconds=ns.timeout)
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # the workers share the agents' store, one for every attempt of a run: after a restart (--max-restarts),
        # keys of the attempt before (where the killed ranks listened) would still be read, and gloo would connect
        # to dead addresses (seen with torch 2.11). Each attempt's process group keys live under a prefix of
        # their own. (The restart count is each agent's own: a node's agent started again after the node was
        # lost counts from 0, so a run that replaces nodes sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, below.)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"schedlang-attempt-{attempt}", store)
    # else rank 0 hosts a new store at a new port for every rendezvous round: no key of an earlier round is there
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        train(ns, rank, world)
        return 0
    except SchedlangError as e:
        print(f"schedlang train: rank {rank}: error: {e}", file=sys.stderr)
        return 2
    except BaseException:
        print(f"schedlang train: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr)
        return 1
    finally:
        # a rank that fails leaves: torchrun stops the others once one exits non-zero
        try:
            dist.destroy_process_group()
        except Exception:  # pragma: no cover
            pass


_OWN_ERRORS = ("TrainError", "CheckpointError", "ScheduleValueError", "ScheduleTypeError", "ShardError")


def _failure_summary(error: DistributedError) -> str:
    """One line per failed rank (its exception), from the launcher's tracebacks."""
    text = str(error)
    lines = []
    # the launcher starts each failed rank's traceback on a line of its own, "rank N failed:"; an error message
    # may itself say "rank 0: ..." (a checkpoint problem found on several ranks), so only those lines split it
    parts = re.split(r"(?m)^rank (\d+) failed:\n", text)
    for head, body in zip(parts[1::2], parts[2::2]):
        body = re.split(r"(?m)^rank\(s\) \[", body)[0]  # the launcher's line on ranks that did not finish
        body_lines = [l for l in body.rstrip().splitlines() if l.strip()]
        # the exception starts at the last unindented "SomeError: ..." line; its message may span lines
        starts = [i for i, l in enumerate(body_lines) if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b", l)]
        last = [" ".join(l.strip() for l in body_lines[starts[-1]:])] if starts else body_lines[-1:]
        if last:
            message = last[-1].strip()
            kind, sep, rest = message.partition(": ")
            if sep and (kind.startswith("schedlang.") or kind in _OWN_ERRORS):  # our own errors read as their message
                message = rest
            lines.append(f"rank {head}: {message}")
    if not lines:
        return text.splitlines()[-1] if text else "distributed run failed"
    # the same error on every rank reads once
    messages = {l.split(": ", 1)[1] for l in lines}
    return lines[0].split(": ", 1)[1] if len(messages) == 1 else "; ".join(lines)


def _check_saved_model(ns: argparse.Namespace, saved, dims) -> None:
    """The checkpoint to resume holds the model this run builds (else its tensors would not fit)."""
    state = read_trainer_state(saved)
    was = state.get("dims")
    if state.get("model") not in (None, ns.model) or (isinstance(was, dict) and was != dataclasses.asdict(dims)):
        def describe(model, d):
            return f"{model} " + ", ".join(f"{k} {v}" for k, v in d.items()) if isinstance(d, dict) else str(model)

        _fail(f"--resume: {saved} holds a {describe(state.get('model'), was)} model (saved with --model "
              f"{state.get('model')} --config {state.get('config')}), but this run builds a "
              f"{describe(ns.model, dataclasses.asdict(dims))} model (--model {ns.model} --config {ns.config}); "
              "resume with the --model and --config the checkpoint was saved with")




def prefer_expandable_segments(ns: argparse.Namespace) -> Optional[str]:
    """Run CUDA with expandable segments unless the environment already sets the allocator; returns what was set.

    With its default setting the caching allocator keeps the blocks a step freed in segments of the sizes first
    asked for, and a later step that asks for other sizes reserves new ones: on the trainer's LLaMA-1B runs the
    reserve over the tensors measured 3 to 35% of the allocated peak (largest under full checkpointing, which
    frees and remakes a layer's activations layer after layer), against 0.1 to 2.8% with expandable segments
    (bench/results/*-planner-validation-reserve-*.json). The planner's memory estimate counts tensors and leaves
    10% of the device for everything else, so only the second keeps a plan that fits from running out of memory.
    Set here, before anything starts CUDA, and inherited by the ranks ``--nproc`` spawns; a torchrun rank sets it
    for itself. A setting of the user's, even ``expandable_segments:False``, is left as it is."""
    # a dry run starts no CUDA, but --trace-memory gpu runs the peak rank on the GPU as the run would
    runs_cuda = not ns.dry_run or getattr(ns, "trace_memory", None) == "gpu"
    if not runs_cuda or _device_type(ns) != "cuda" or any(v in os.environ for v in ALLOCATOR_VARIABLES):
        return None
    if torch.cuda.is_initialized():  # a caller that used CUDA already: its allocator has read its settings
        logger.info("CUDA is already initialized in this process: its caching allocator keeps its settings")
        return None
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE_SEGMENTS
    return EXPANDABLE_SEGMENTS


def main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    """The command line; returns the exit status (0 done, 2 bad flags or files, 1 a failed run)."""
    parser = build_parser(prog)
    ns = parser.parse_args(list(argv) if argv is not None else None)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    quiet_torchao_import()  # before the model's config is read: that imports transformers, and so torchao
    if prefer_expandable_segments(ns):
        logger.info("CUDA caching allocator: %s (set PYTORCH_ALLOC_CONF to choose another)", EXPANDABLE_SEGMENTS)
    env_world = _world_from_env()
    if ns.nproc is not None and env_world is not None and env_world > 1:
        print("schedlang train: error: --nproc spawns its own ranks; do not combine it with torchrun", file=sys.stderr)
        return 2
    world = ns.nproc if ns.nproc is not None else (env_world or 1)
    is_main = os.environ.get("RANK", "0") == "0"  # under torchrun every rank checks: one speaks
    try:
        world = validate(ns, world)  # a dry run of --nodes x --gpus-per-node plans for that cluster
        facts = model_facts(ns, check_tensor_parallel=world > 1)
        if ns.layout == "auto":
            # a first choice from the devices as read here (the ranks measure the link and may choose again)
            choice = choose(ns, facts, hardware(ns, world), world)
            apply_layout(ns, choice.best.layout, world)
            if ns.dry_run and is_main:
                print(choice_block(choice), file=sys.stderr)
        check_model_layout(ns, facts)
        # the data: token files opened, text tokenized into its cache (once, here: the ranks read the cache)
        open_data(ns, facts.dims.vocab, mode="prepare" if is_main and not ns.dry_run else "check")
        if ns.init_from is not None:
            from ..pretrained import read_index

            read_index(ns.init_from)  # readable safetensors, before any rank starts
        if ns.resume:
            # none yet (a first start, or a restart before the first save finished): the run starts fresh, so
            # the same command line serves the first start and every restart
            saved = latest_checkpoint(ns.checkpoint_dir)
            at = int(saved.name[len(_CKPT_PREFIX):]) if saved is not None else 0
            if saved is not None:
                _check_saved_model(ns, saved, facts.dims)
            if saved is not None and at >= (ns.stop_after or ns.steps) and not ns.dry_run:
                # the run is done: a restart after its last save (an elastic agent restarting its workers when
                # another node rejoins, say) or the command run again has nothing to do, and that is no failure
                if is_main:
                    print(f"schedlang train: the run is complete: the latest checkpoint ({saved}) is at step {at} of "
                          f"{ns.stop_after or ns.steps}; nothing to do (raise --steps to train further)",
                          file=sys.stderr)
                return 0
        elif ns.checkpoint_dir and latest_checkpoint(ns.checkpoint_dir) is not None:
            # a fresh run would save among another run's checkpoints, and a later --resume take the newest of either
            _fail(f"--checkpoint-dir {ns.checkpoint_dir} already holds checkpoints of a run (the latest is "
                  f"{latest_checkpoint(ns.checkpoint_dir).name}); pass --resume to continue it, or give another "
                  "--checkpoint-dir to start a new run")
        if ns.dry_run:
            traced = None
            if ns.trace_memory == "gpu" and is_main:  # before the plan block, whose --json takes the peaks
                from .rank_on_gpu import rank_on_gpu_json, run_rank_on_gpu

                traced = run_rank_on_gpu(ns, facts, world)
                ns._traced_json = rank_on_gpu_json(traced)
            elif ns.trace_memory and is_main:
                from .trace_memory import trace_peak, traced_json

                traced = trace_peak(ns, facts, world)
                ns._traced_json = traced_json(traced)
            if is_main:
                print(plan_block(ns, facts, hardware(ns, world), world), file=sys.stderr)
                if traced is not None:
                    print(f"schedlang train: {traced.line()}", file=sys.stderr)
            return 0
    except SchedlangError as e:
        if is_main:
            print(f"schedlang train: error: {e}", file=sys.stderr)
        return 2
    try:
        if env_world is not None and env_world > 1:
            return _torchrun_main(ns, env_world)
        if world == 1:
            train(ns)
            return 0
        from ..distributed.launch import run_distributed

        options = dict(vars(ns), _log_level=logging.getLogger("schedlang").getEffectiveLevel())
        backend = "nccl" if _device_type(ns) == "cuda" else "gloo"
        if backend == "nccl" and torch.cuda.device_count() < world:
            _fail(f"--nproc {world} on cuda needs {world} GPUs, found {torch.cuda.device_count()}")
        run_distributed(_rank_main, world_size=world, args=(options,), backend=backend, timeout=365 * 86400.0,
                        collective_timeout=ns.timeout)
        return 0
    except SchedlangError as e:
        if isinstance(e, DistributedError):
            logger.debug("%s", e)
            print(f"schedlang train: error: {_failure_summary(e)}", file=sys.stderr)
            return 1
        print(f"schedlang train: error: {e}", file=sys.stderr)
        return 2
