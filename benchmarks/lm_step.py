"""The anchor GPT training step (forward, backward, AdamW) as one pure function, run through `pf.jit`.

Same model, flags, timing and JSON fields as `shared/bench/anchor_lm_step.py`, so its rows sit beside the
anchor's torch eager / torch.compile / JAX jit rows: 12 layers, d=1024, 16 heads, seq 1024, batch 16,
vocab 32768, tied embeddings, pre-LN, GELU (tanh), bias-free linears, LayerNorms with bias, bf16 matmuls
over fp32 master weights, fp32 logits and cross-entropy, AdamW(lr=3e-4, betas=(0.9, 0.999), eps=1e-8,
weight_decay=0.01) from `pf.optim`. The params are a nested dict; the whole step is
`pf.jit(train_step, donate_argnums=(0, 1))`.

    python benchmarks/lm_step.py                                  # H200: the anchor's config
    python benchmarks/lm_step.py --no-donate                      # functional update without donation
    python benchmarks/lm_step.py --precision autocast             # torch.autocast instead of in-step casts
    python benchmarks/lm_step.py --cuda-graphs                    # replay the step as one CUDA graph
    python benchmarks/lm_step.py --policy dots_saveable           # pf.checkpoint(block, policy) per block
    python benchmarks/lm_step.py --memory-budget 0.5              # pf.jit(memory_budget=0.5)
    torchrun --standalone --nproc-per-node 2 benchmarks/lm_step.py --sharding dp     # batch sharded
    torchrun --standalone --nproc-per-node 2 benchmarks/lm_step.py --sharding fsdp   # + params and state
    torchrun --standalone --nproc-per-node 2 benchmarks/lm_step.py --sharding dp --grad-exchange int8
    torchrun --standalone --nproc-per-node 2 benchmarks/lm_step.py --sharding dp --grad-exchange int8 \\
        --exchange-bucket-mib 0                                   # one compressed reduction per leaf
    python benchmarks/lm_step.py --layers 2 --d 64 --heads 4 --seq 32 --batch 2 --vocab 256 --steps 3 \\
        --device cpu --threads 1

Prints one JSON line with the anchor's fields (impl, params_m, step_ms, tokens_per_s, mfu, peak_mem_gib, loss)
plus pf.jit's own: compile_s (first call: trace + Inductor compile + one step), trace_s (`step.lower`),
n_nodes, pt3func's `memory_analysis()` peaks (the compiled program's, and the traced program's bound) with
their ratios to the measured peak, and `cost_analysis()` flops beside the analytic flops; appends the same
record to `--out`. With `--max-memory-gib` a step that runs out of memory prints `{"oom": true, ...}` instead
(benchmarks/memory.py searches the largest batch that fits with it).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import RESULTS, append_jsonl, arrive_and_wait, environment
from torch.distributed.tensor import DTensor, Shard

import pt3func as pf
from pt3func import NamedSharding, P

Params = dict[str, Any]

# --grad-exchange name -> the pf.compress format (None: the program's own fp32 all-reduce).
GRAD_EXCHANGES: dict[str, Any] = {
    "fp32": None,
    "bf16": lambda: pf.compress.bf16(),
    "fp16": lambda: pf.compress.fp16(),
    "int8": lambda: pf.compress.int8(error_feedback=True),
    "int4": lambda: pf.compress.int4(error_feedback=True),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The anchor's flags, same names and defaults.
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--peak_tflops", type=float, default=989.0)  # H100/H200 dense bf16 datasheet, as the anchor
    # pf.jit's own.
    p.add_argument("--backend", choices=("inductor", "eager"), default="inductor")
    p.add_argument("--no-donate", action="store_true", help="do not donate params and optimizer state")
    p.add_argument(
        "--precision",
        choices=("bf16", "autocast"),
        default="bf16",
        help="bf16: cast the fp32 master weights to bf16 inside the step and keep activations (residual "
        "stream included) in bf16, as the anchor's JAX version does; autocast: torch.autocast around the "
        "forward, fp32 residual stream, as the anchor's torch versions do",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--sharding",
        choices=("none", "dp", "fsdp"),
        default="none",
        help="under torchrun: dp = batch sharded over all ranks (--batch per rank, as the anchor's DDP); "
        "fsdp = params and optimizer state sharded on dim 0 too (where it divides, as the anchor's jax-fsdp)",
    )
    p.add_argument(
        "--grad-exchange",
        choices=tuple(GRAD_EXCHANGES),
        default="fp32",
        help="with --sharding: how gradients are reduced (pf.jit(grad_exchange=...)); fp32: the plain all-reduce; "
        "int8/int4 with error feedback, its residuals carried in the optimizer state",
    )
    p.add_argument(
        "--exchange-bucket-mib",
        type=float,
        default=None,
        help="with --grad-exchange: pf.config.grad_exchange_bucket_bytes in MiB (gradients packed per compressed "
        "reduction; 0: one per leaf; default: pf.config's, 64 MiB)",
    )
    p.add_argument(
        "--gradient-bucket-mib",
        type=float,
        default=None,
        help="pf.config.gradient_bucket_bytes in MiB: data parallel gradient all-reduces packed into buckets "
        "(as DDP's 25 MiB; default: pf.config's, off)",
    )
    p.add_argument("--overlap", action="store_true", help="Inductor's compute/communication reordering pass")
    p.add_argument(
        "--bucket",
        nargs="?",
        const="on",
        default=None,
        choices=("auto", "on", "off"),
        help="pf.config.bucket_collectives: Inductor's collective bucketing passes (bare --bucket: on; default: "
        "pf.config's, auto: on for FSDP on GPUs)",
    )
    p.add_argument(
        "--overlap-scheduler",
        action="store_true",
        help="Inductor's newer compute/communication overlap scheduler (crashed on this program in torch 2.11)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads (CPU smoke runs: 1 on a shared machine, where OpenMP's spinning threads "
        "make a tiny step 100x slower)",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="TRACE.json",
        help="after timing, profile 3 steps: print kernel time by kind and exposed NCCL time (rank 0), add "
        "them to the record, write the chrome trace here",
    )
    p.add_argument(
        "--dump-code",
        default=None,
        help="write the Inductor program the step ran (Compiled.generated_code()) to this file, and print the "
        "largest buffers live at its memory peak",
    )
    p.add_argument("--out", default=None, help="JSONL file to append the record to (default: results/lm_step_*)")
    # Memory (benchmarks/memory.py runs this script with these).
    p.add_argument("--cuda-graphs", action="store_true", help="pf.jit(cuda_graphs=True): replay one CUDA graph")
    p.add_argument(
        "--policy",
        choices=tuple(REMAT_POLICIES),
        default="none",
        help="pf.checkpoint(block, policy=...) around every transformer block (none: no remat); see REMAT_POLICIES",
    )
    p.add_argument(
        "--remat-blocks",
        type=int,
        default=None,
        help="with --policy: checkpoint only the first N blocks (default: all); the rest keep everything",
    )
    p.add_argument(
        "--inductor-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set torch._inductor.config.NAME (a Python literal) before compiling; repeatable "
        "(realize_reads_threshold=8: Inductor keeps fewer reused pointwise values as buffers)",
    )
    p.add_argument(
        "--fence-backward",
        default=None,
        metavar="OPS",
        help="pf.config.fence_backward_ops: 'all', or comma-separated aten backward ops (native_layer_norm_backward) "
        "whose forward inputs are read behind their gradient (default: pf.config's, off)",
    )
    p.add_argument("--memory-budget", type=float, default=None, help="pf.jit(memory_budget=...): automatic remat")
    p.add_argument(
        "--no-locality-reorder",
        action="store_true",
        help="pf.config.inductor_reorder_for_locality = False (Inductor's pass that sinks each weight gradient, "
        "and a recomputed value it reads, to the optimizer update at the end of the step)",
    )
    p.add_argument(
        "--loss-chunk-mib",
        type=float,
        default=None,
        help="pf.config.loss_chunk_bytes: the loss head (logits, cross-entropy, its backward) in row chunks of at "
        "most this many MiB of fp32 logits (default: pf.config's, off)",
    )
    p.add_argument(
        "--sdpa-priority",
        default=None,
        metavar="BACKENDS",
        help="comma-separated SDPA backends in priority order (cudnn,flash,efficient,math), set process-wide "
        "before tracing (torch.nn.attention.sdpa_kernel(..., set_priority=True))",
    )
    p.add_argument(
        "--max-memory-gib",
        type=float,
        default=None,
        help="cap the process's GPU memory (torch.cuda.set_per_process_memory_fraction) and report an OOM as "
        '{"oom": true}; on CPU (smoke runs) the compiled program\'s memory_analysis() peak is compared instead',
    )
    p.add_argument(
        "--timing-lock",
        default=None,
        help="a file to flock while running and timing: concurrent runs compile in parallel, time one at a time",
    )
    p.add_argument(
        "--timing-barrier",
        default=None,
        help="DIR:N:ID: after compiling, wait until N concurrent runs have (benchmarks/common.arrive_and_wait)",
    )
    return p.parse_args(argv)


# --policy name -> what each transformer block keeps for the backward (names are tagged in `block`).
REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "everything_saveable": lambda: pf.checkpoint_policies.everything_saveable,
    "nothing_saveable": lambda: pf.checkpoint_policies.nothing_saveable,
    "dots_saveable": lambda: pf.checkpoint_policies.dots_saveable,
    # Matmul and attention outputs kept; LayerNorms and GELU recomputed (what AOTAutograd's partitioner
    # recomputes for torch.compile).
    "dots_attn_saveable": lambda: pf.checkpoint_policies.save_only_these_names("qkv", "attn", "proj", "fc"),
    # Everything but the GELU output (the largest cheap value: 4 d per token); the weights' bf16 casts are
    # recomputed too (the names list no cast).
    "recompute_gelu": lambda: pf.checkpoint_policies.save_only_these_names("ln1", "qkv", "attn", "proj", "ln2", "fc"),
    # Only the GELU output recomputed; the bf16 weight casts kept from the forward, as without remat. In the
    # whole-step program Inductor fused a recomputed cast with that weight's AdamW update (both read the fp32
    # weight), which then ran after the weight gradient's matmul, and the block's input-gradient matmul, which
    # reads the cast, had to wait for it: the recomputed GELU could then not share a kernel with its backward.
    "gelu_only": lambda: pf.checkpoint_policies.save_only_these_names(
        "ln1", "qkv", "attn", "proj", "ln2", "fc", "weight"
    ),
    # The attention output in pinned host memory; everything else recomputed.
    "offload": lambda: pf.checkpoint_policies.offload_to_host("attn"),
    # What "offload" recomputes, with the attention output kept on the device (its memory/speed baseline).
    "attn_saveable": lambda: pf.checkpoint_policies.save_only_these_names("attn"),
}


def pf_config_of(a: argparse.Namespace) -> dict[str, Any]:
    """The `pf.config` fields a run's flags set (only those given)."""
    fields: dict[str, Any] = {}
    if a.exchange_bucket_mib is not None:
        fields["grad_exchange_bucket_bytes"] = int(a.exchange_bucket_mib * 2**20)
    if a.gradient_bucket_mib is not None:
        fields["gradient_bucket_bytes"] = int(a.gradient_bucket_mib * 2**20)
    if a.bucket is not None:
        fields["bucket_collectives"] = a.bucket
    if a.fence_backward is not None:
        names = frozenset(n.strip() for n in a.fence_backward.split(",") if n.strip())
        fields["fence_backward_ops"] = True if names == {"all"} else names
    if a.loss_chunk_mib is not None:
        fields["loss_chunk_bytes"] = int(a.loss_chunk_mib * 2**20)
    if getattr(a, "no_locality_reorder", False):
        fields["inductor_reorder_for_locality"] = False
    return fields


def build_run(a: argparse.Namespace, device: torch.device, mesh: Any = None) -> tuple[Any, ...]:
    """(jitted step, params, optimizer state, idx, tgt, grad exchange or None) for the run's flags.

    With a `mesh` (1-D, "dp"), the batch is each rank's own (seeded by rank, as the anchor's DDP) and the params
    are replicated (`--sharding dp`) or sharded on their first dim (`fsdp`).
    """
    params = init_params(a, device)
    exchange = GRAD_EXCHANGES[a.grad_exchange]() if GRAD_EXCHANGES[a.grad_exchange] else None
    train_step, opt = make_train_step(a, device.type, exchange)
    jit_kwargs = {} if exchange is None else {"grad_exchange": exchange}
    jit_kwargs.update(memory_options(a))
    step = pf.jit(train_step, donate_argnums=() if a.no_donate else (0, 1), backend=a.backend, **jit_kwargs)
    rank = 0 if mesh is None else torch.distributed.get_rank()
    torch.manual_seed(rank)  # each rank its own batch, as the anchor's DDP
    idx = torch.randint(0, a.vocab, (a.batch, a.seq), device=device)
    tgt = torch.randint(0, a.vocab, (a.batch, a.seq), device=device)
    if mesh is not None:
        # The global batch is every rank's local batch stacked: a DTensor sharded on dim 0, built without comm.
        idx, tgt = (DTensor.from_local(t, mesh.device_mesh, [Shard(0)], run_check=False) for t in (idx, tgt))
        specs = pf.tree.map(
            lambda t: P("dp") if a.sharding == "fsdp" and t.shape[0] % mesh.size == 0 else P(), params
        )
        params = pf.device_put(params, pf.tree.map(lambda s: NamedSharding(mesh, s), specs))
        opt_state = pf.jit(opt.init, backend=a.backend)(params)  # state created where its shards live
        if exchange is not None:
            # (optimizer state, error-feedback residuals): the step donates and returns both.
            opt_state = (opt_state, exchange.init(params))
    else:
        opt_state = opt.init(params) if exchange is None else (opt.init(params), exchange.init(params))
    return step, params, opt_state, idx, tgt, exchange


def memory_options(a: argparse.Namespace) -> dict[str, Any]:
    """pf.jit options from the memory flags (only those given, so older runs' programs are unchanged)."""
    options: dict[str, Any] = {}
    if getattr(a, "cuda_graphs", False):
        options["cuda_graphs"] = True
    if getattr(a, "memory_budget", None) is not None:
        options["memory_budget"] = a.memory_budget
    return options


def init_params(a: argparse.Namespace, device: torch.device | str) -> Params:
    """fp32 master weights, N(0, 0.02) as in the anchor's JAX version; nn.Linear's (out, in) layout."""
    torch.manual_seed(0)
    d = a.d

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device) * 0.02

    def norm() -> Params:
        return {"weight": torch.ones(d, device=device), "bias": torch.zeros(d, device=device)}

    return {
        "emb": normal(a.vocab, d),
        "blocks": {
            str(i): {
                "ln1": norm(),
                "qkv": normal(3 * d, d),
                "proj": normal(d, d),
                "ln2": norm(),
                "fc": normal(4 * d, d),
                "out": normal(d, 4 * d),
            }
            for i in range(a.layers)
        },
        "lnf": norm(),
    }


def make_train_step(
    a: argparse.Namespace, device_type: str, exchange: Any = None
) -> tuple[Any, pf.optim.GradientTransformation]:
    """The whole step as a pure function of (params, opt_state, idx, tgt), and its optimizer.

    With a grad `exchange`, `opt_state` is `(optimizer state, exchange state)` and the step's optimizer
    passes the exchange state through (`pf.compress.with_state`); the returned optimizer is the inner one.
    """
    heads, head_dim = a.heads, a.d // a.heads
    # In "bf16" mode every activation is bf16, so the weights are cast to it (a LayerNorm's too: its kernel
    # wants one dtype, and accumulates in fp32 regardless). In "autocast" mode nothing is cast by hand.
    cast = (lambda w: w.to(torch.bfloat16)) if a.precision == "bf16" else (lambda w: w)

    def layer_norm(x: torch.Tensor, p: Params) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], cast(p["weight"]), cast(p["bias"]))

    make_policy = REMAT_POLICIES[getattr(a, "policy", "none")]
    # Names for the name-based remat policies; without a policy nothing is tagged (the program is unchanged).
    tag = (lambda x, name: x) if make_policy is None else pf.checkpoint_name

    def weight(w: torch.Tensor) -> torch.Tensor:
        return tag(cast(w), "weight")

    def block(x: torch.Tensor, p: Params) -> torch.Tensor:
        b, s, d = x.shape
        qkv = tag(F.linear(tag(layer_norm(x, p["ln1"]), "ln1"), weight(p["qkv"])), "qkv")
        q, k, v = qkv.view(b, s, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        y = tag(F.scaled_dot_product_attention(q, k, v, is_causal=True), "attn")
        x = x + tag(F.linear(y.transpose(1, 2).reshape(b, s, d), weight(p["proj"])), "proj")
        f = tag(F.linear(tag(layer_norm(x, p["ln2"]), "ln2"), weight(p["fc"])), "fc")
        h = tag(F.gelu(f, approximate="tanh"), "gelu")
        return x + F.linear(h, weight(p["out"]))

    # Selective remat: only the first --remat-blocks blocks are checkpointed (every block's activations are live
    # at the start of the backward, so which blocks matters less than how many).
    remat_blocks = a.layers if getattr(a, "remat_blocks", None) is None else a.remat_blocks
    if not 0 <= remat_blocks <= a.layers:
        raise SystemExit(f"--remat-blocks {remat_blocks}: the model has {a.layers} blocks")
    blocks = [block] * a.layers
    if make_policy is not None:
        checkpointed = pf.checkpoint(block, policy=make_policy())
        blocks = [checkpointed if i < remat_blocks else block for i in range(a.layers)]

    def forward_loss(params: Params, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        emb = cast(params["emb"])  # cast once: read by the lookup and by the tied unembedding
        x = F.embedding(idx, emb)
        for i in range(a.layers):
            x = blocks[i](x, params["blocks"][str(i)])
        logits = F.linear(layer_norm(x, params["lnf"]), emb)
        return F.cross_entropy(logits.float().view(-1, a.vocab), tgt.view(-1))

    def loss_fn(params: Params, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        if a.precision == "autocast":
            # Only the forward is under autocast, as in the anchor: the backward runs outside it.
            with torch.autocast(device_type, dtype=torch.bfloat16):
                return forward_loss(params, idx, tgt)
        return forward_loss(params, idx, tgt)

    opt = pf.optim.adamw(3e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)  # torch.optim.AdamW's defaults

    step_opt = opt if exchange is None else pf.compress.with_state(opt, exchange)

    def train_step(params: Params, opt_state: Any, idx: torch.Tensor, tgt: torch.Tensor) -> Any:
        loss, grads = pf.value_and_grad(loss_fn)(params, idx, tgt)
        updates, opt_state = step_opt.update(grads, opt_state, params)
        return pf.optim.apply_updates(params, updates), opt_state, loss

    return train_step, opt


def main() -> None:
    a = parse_args()
    device = torch.device(a.device)
    if a.threads:
        torch.set_num_threads(a.threads)
    on_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    L, D, S, B, V = a.layers, a.d, a.seq, a.batch, a.vocab
    # The anchor's formulas, so MFU is counted the same way.
    n_params = V * D + L * (12 * D * D + 4 * D) + 2 * D
    flops_per_step = 6 * n_params * B * S + 12 * L * D * S * B * S

    world, rank, mesh = 1, 0, None
    if a.sharding != "none":
        mesh = pf.make_mesh((int(os.environ.get("WORLD_SIZE", "1")),), ("dp",))
        world, rank = mesh.size, torch.distributed.get_rank()
        device = torch.device(a.device, torch.cuda.current_device()) if on_cuda else device
    for name, value in pf_config_of(a).items():
        setattr(pf.config, name, value)
    if a.overlap:
        torch._inductor.config.reorder_for_compute_comm_overlap = True
    if a.sdpa_priority:
        from torch.nn.attention import SDPBackend, _sdpa_kernel

        names = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}
        _sdpa_kernel([getattr(SDPBackend, names[n]) for n in a.sdpa_priority.split(",")], set_priority=True)
    if a.inductor_option:
        _set_inductor_options({k: ast.literal_eval(v) for k, _, v in (o.partition("=") for o in a.inductor_option)})
    if a.overlap_scheduler:
        _set_inductor_options({"aten_distributed_optimizations.enable_overlap_scheduling": True})
    assert sum(t.numel() for t in pf.tree.leaves(init_params(a, "meta"))) == n_params, "not the anchor's model"
    step, params, opt_state, idx, tgt, exchange = build_run(a, device, mesh)

    precompile_s = None
    if a.timing_lock or a.max_memory_gib:
        # Compile before taking the lock (CPU work that concurrent runs may share the machine for).
        start = time.perf_counter()
        compiled = step.lower(params, opt_state, idx, tgt).compile()
        precompile_s = round(time.perf_counter() - start, 2)
    oom_record = dict(impl="pt3func-jit", oom=True, batch=B, policy=a.policy, memory_budget=a.memory_budget)
    if a.max_memory_gib and on_cuda:
        index = torch.cuda.current_device()  # `device` may be plain "cuda", which this call refuses
        torch.cuda.set_per_process_memory_fraction(
            min(a.max_memory_gib * 2**30 / torch.cuda.get_device_properties(index).total_memory, 1.0), index
        )
    elif a.max_memory_gib and compiled.memory_analysis()["peak_bytes"] > a.max_memory_gib * 2**30:
        print(json.dumps(dict(oom_record, emulated=True)), flush=True)  # CPU smoke runs: the estimate decides
        return
    arrive_and_wait(a.timing_barrier)
    lock = _hold(a.timing_lock)
    # The anchor's timing: 3 warm-up steps (the first one compiles), then the median of --steps.
    times = []
    try:
        for _ in range(a.steps + 3):
            sync()
            start = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, idx, tgt)
            sync()
            times.append(time.perf_counter() - start)
    except torch.OutOfMemoryError:
        if not a.max_memory_gib:
            raise
        print(json.dumps(oom_record), flush=True)
        return
    finally:
        if lock is not None:
            lock.close()
    peak = torch.cuda.max_memory_allocated() if on_cuda else None
    # The loss after the timed steps (the profile below runs 3 more: profiled and unprofiled runs compare equal).
    loss = float(pf.device_get(loss))
    profile = None
    if a.profile and on_cuda:
        from gpu_profile import format_summary, profile_steps

        def step_once() -> None:
            nonlocal params, opt_state
            params, opt_state, _ = step(params, opt_state, idx, tgt)
            sync()

        profile = profile_steps(step_once, 3, a.profile.replace(".json", f".rank{rank}.json"))
        if rank == 0:
            print(format_summary(profile), flush=True)
    reserved = torch.cuda.max_memory_reserved() if on_cuda else None

    # lower() traces again, in fake mode (no compute, no memory), for the program's size and analyses.
    start = time.perf_counter()
    lowered = step.lower(params, opt_state, idx, tgt)
    trace_s = time.perf_counter() - start
    memory, cost = lowered.memory_analysis(), lowered.cost_analysis()
    compiled_memory = lowered.compile().memory_analysis()  # the program the calls ran: not compiled again
    if a.dump_code and rank == 0:
        dump_program(lowered.compile().generated_code(), a.dump_code, device.type)

    med = statistics.median(times[3:])
    record = dict(
        impl="pt3func-jit" + ("" if a.sharding == "none" else f"-{a.sharding}"),
        gpus=world,
        params_m=round(n_params / 1e6, 1),
        step_ms=round(med * 1e3, 2),
        step_times_ms=[round(t * 1e3, 2) for t in times],  # every call, the 3 warm-up calls (compiles) first
        tokens_per_s=round(world * B * S / med),
        mfu=round(flops_per_step / med / (a.peak_tflops * 1e12), 4),
        peak_mem_gib=round(peak / 2**30, 2) if on_cuda else None,
        loss=loss,
        compile_s=round(times[0], 2),
        trace_s=round(trace_s, 2),
        n_nodes=len(lowered.graph_module.graph.nodes),
        pf_peak_mem_gib=round(memory["peak_bytes"] / 2**30, 2),
        pf_peak_bytes=memory["peak_bytes"],
        pf_compiled_peak_mem_gib=round(compiled_memory["peak_bytes"] / 2**30, 2),
        pf_compiled_peak_bytes=compiled_memory["peak_bytes"],
        pf_compiled_peak_over_measured=round(compiled_memory["peak_bytes"] / peak, 3) if on_cuda else None,
        pf_peak_over_measured=round(memory["peak_bytes"] / peak, 3) if on_cuda else None,
        peak_reserved_gib=round(reserved / 2**30, 2) if on_cuda else None,
        precompile_s=precompile_s,
        pf_flops=cost["flops"],
        analytic_flops=flops_per_step,
        pf_flops_over_analytic=round(cost["flops"] / flops_per_step, 4),
        backend=a.backend,
        donate=not a.no_donate,
        precision=a.precision,
        overlap=a.overlap,
        bucket=pf.config.bucket_collectives,  # "auto" on for FSDP on GPUs (older records: True/False)
        overlap_scheduler=a.overlap_scheduler,
        cuda_graphs=a.cuda_graphs,
        policy=a.policy,
        remat_blocks=a.remat_blocks,
        memory_budget=a.memory_budget,
        inductor_options=a.inductor_option,
        sdpa_priority=a.sdpa_priority,
        loss_chunk_bytes=pf.config.loss_chunk_bytes,
        fence_backward=sorted(f) if isinstance(f := pf.config.fence_backward_ops, frozenset) else f,
        comm_bytes=cost["comm_bytes"],
        profile=profile,
        grad_exchange=a.grad_exchange if exchange is None else f"{a.grad_exchange} ({exchange.describe()})",
        # Compressed reductions packed into buckets of this many MiB of gradients (pf.config), and the program's
        # collectives (per leaf, int8 has 2 per gradient; bucketed, 2 per bucket).
        exchange_bucket_mib=None if exchange is None else (pf.config.grad_exchange_bucket_bytes or 0) / 2**20,
        n_collectives=sum(1 for n in lowered.graph_module.graph.nodes if pf.analysis.is_collective(n)),
        # pf.jit's exchange guard (pf.compress.Guard): compression kept or switched off, both medians, the reason.
        exchange_decision=dataclasses.asdict(step.exchange_decision()) if step.exchange_decision() else None,
        config=dict(layers=L, d=D, heads=a.heads, seq=S, batch=B, vocab=V, steps=a.steps, device=a.device),
        env=environment(),
    )
    if rank != 0:
        torch.distributed.destroy_process_group()
        return
    print(json.dumps(record), flush=True)
    measured = f"measured {peak / 2**30:.3g} GiB; " if on_cuda else ""
    print(
        f"memory: {measured}compiled-program estimate {compiled_memory['peak_bytes'] / 2**30:.3g} GiB"
        + (f" ({record['pf_compiled_peak_over_measured']}x)" if on_cuda else "")
        + f"; traced-program bound {memory['peak_bytes'] / 2**30:.3g} GiB"
        + (f" ({record['pf_peak_over_measured']}x)" if on_cuda else ""),
        flush=True,
    )
    out = a.out or RESULTS / f"lm_step_{_device_slug(device)}.jsonl"
    print(f"appended to {append_jsonl(out, record)}")


def dump_program(code: str | None, path: str, device_type: str) -> None:
    """Write the generated program to `path` and print what it holds at its peak (largest first)."""
    from pt3func.runtime.inductor_memory import wrapper_memory

    if code is None:
        print("no generated program (eager backend)")
        return
    Path(path).write_text(code)
    replay = wrapper_memory(code, device_type)
    if replay is None:
        return
    lines = code[code.index("def call(") :].splitlines()
    peak_line = next((i for i, line in enumerate(lines) if replay.peak_statement in line), -1)
    print(f"program peak {replay.peak_bytes / 2**30:.3g} GiB beyond its arguments, at line {peak_line} of "
          f"{len(lines)}: {replay.peak_statement[:160]}")
    by_writer: dict[str, list[int]] = {}
    for name, size in replay.live_at_peak:
        by_writer.setdefault(_writer(lines, name), []).append(size)
    # Grouped by the kernel that wrote them (the line number is where it runs), largest groups first.
    for writer, sizes in sorted(by_writer.items(), key=lambda item: -sum(item[1]))[:30]:
        print(f"  {sum(sizes) / 2**20:9.1f} MiB in {len(sizes):3d} x {writer}")


def _writer(lines: list[str], name: str) -> str:
    """`line: kernel` of the first call after `name`'s allocation that passes it, numbers stripped from the name."""
    import re

    start = next((i for i, line in enumerate(lines) if re.match(rf"\s*{name} = ", line)), None)
    if start is None:
        return "?"
    for i in range(start, min(start + 80, len(lines))):
        text = lines[i].strip()
        if re.search(rf"\b{name}\b", text) and "(" in text and not text.startswith((f"{name} =", "del ", "#")):
            kernel = re.sub(r"_\d+$", "", text.split("(")[0])
            return f"line {i}: {kernel[:110]}"
    return f"line {start}: {lines[start].strip()[:110]}"


def _hold(path: str | None) -> Any:
    """An open file holding an exclusive flock on `path` (None without a path); closing it releases it."""
    if path is None:
        return None
    import fcntl

    f = open(path, "a")  # noqa: SIM115 (held open until the timed steps end)
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def _set_inductor_options(options: dict[str, Any]) -> None:
    """Set the Inductor options this torch version has (the names moved between 2.11 and 2.13)."""
    config = torch._inductor.config
    known = config.get_config_copy()
    for name, value in options.items():
        if name in known:
            config.__setattr__(name, value) if "." not in name else _set_nested(config, name, value)
            print(f"inductor option {name} = {value}")
        else:
            print(f"inductor option {name} not in this torch version")


def _set_nested(config: Any, name: str, value: Any) -> None:
    head, tail = name.split(".", 1)
    setattr(getattr(config, head), tail, value)


def _device_slug(device: torch.device) -> str:
    """`nvidia-h200` for an H200, `cpu` on the CPU: one results file per kind of device."""
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device).lower().replace(" ", "-")


if __name__ == "__main__":
    main()
