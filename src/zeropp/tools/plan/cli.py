"""``zeropp plan``: predict a training step of every mode on a cluster, recommend a configuration,
calibrate the model on the emulated cluster, or reproduce the ZeRO++ paper's figures on paper."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeropp.tools.models import GPT, GPTConfig
from zeropp.tools.modes import MODES, parse_modes

MACHINES = ("v100", "h100")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt:40x6144",
                        help="gpt:LAYERSxWIDTH (zeropp's GPT-2 style model, vocabulary 50257), hf:CONFIG.json (a "
                             "Hugging Face config), or paper:18B / paper:138B (default gpt:40x6144, the paper's 18B)")
    parser.add_argument("--gpus", type=int, default=384)
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: the machine's (v100 16, h100 8)")
    parser.add_argument("--machine", choices=MACHINES, default="v100",
                        help="constants of the GPU and node (zeropp.tools.plan.scale); the flags below override them")
    parser.add_argument("--inter-node-gbit", type=float, default=None, help="per node, one direction")
    parser.add_argument("--intra-node-gbyte", type=float, default=None, help="per GPU, one direction (GB/s)")
    parser.add_argument("--tflops", type=float, default=None, help="sustained per GPU")
    parser.add_argument("--memory-gb", type=float, default=None, help="per GPU")
    parser.add_argument("--host-device-gbyte", type=float, default=None,
                        help="per GPU, each direction (GB/s), for --offload's copies; default: the machine's "
                             "PCIe x16 with pinned memory (v100 12: Gen3; h100 50: Gen5)")
    parser.add_argument("--overlap", type=float, default=1.0,
                        help="fraction of prefetched communication that overlaps compute (1 ideal, 0 none)")
    parser.add_argument("--batch-per-gpu", type=int, default=2, help="sequences per GPU per step")
    parser.add_argument("--context", type=int, default=512, help="sequence length")
    parser.add_argument("--no-checkpointing", action="store_true", help="keep every activation (default: recompute)")
    parser.add_argument("--modes", type=lambda text: parse_modes(text, MODES), default=("zero3", "hsdp", "qwz", "hpz",
                                                                                        "qgz", "all"))
    parser.add_argument("--expert-parallel", type=int, default=1, metavar="E",
                        help="an MoE model (hf:CONFIG.json with routed experts) with torchtitan's expert parallel of "
                             "degree E: the experts sharded over their own mesh, the tokens' all-to-alls priced; "
                             "modes with hpZ, HSDP or tensor parallel are left out")
    parser.add_argument("--pipeline-parallel", type=int, default=1, metavar="P",
                        help="torchtitan's pipeline parallel of degree P (stages of whole nodes, 1F1B) x FSDP on each "
                             "stage: each unit gathered once a step and reduced once, the 1F1B bubble, the "
                             "activations' sends; modes with hpZ, HSDP or tensor parallel are left out")
    parser.add_argument("--microbatch-size", type=int, default=1,
                        help="with --pipeline-parallel: sequences per microbatch (torchtitan's default, 1)")
    parser.add_argument("--offload", choices=("none", "cpu", "optimizer"), default="none",
                        help="ZeroPPConfig.offload; adds host memory and the host-device copies, their time in the "
                             "step. cpu: FSDP2's CPU offload (DeepSpeed's offload_param, with or without "
                             "offload_optimizer): shards, gradient shards and the optimizer on the host. optimizer: "
                             "zeropp's HostOptimizer (DeepSpeed's offload_optimizer alone, ZeRO-Offload): fp32 "
                             "masters and the optimizer on the host, each gradient shard copied there and each "
                             "updated shard back after backward")
    parser.add_argument("--no-pin-memory", action="store_true",
                        help="with --offload cpu: pageable host memory, whose copies block the step")
    parser.add_argument("--json", action="store_true", help="print the modes as JSON (seconds, bytes)")
    parser.add_argument("--explain", metavar="MODE", default=None,
                        help="print zeropp.explain's table of MODE on the cluster (rank 0): every unit's collectives, "
                             "code, bound and bytes per step, from the model built on the meta device")
    parser.add_argument("--recommend", action="store_true", help="the configuration to use, and why")
    parser.add_argument("--calibrate", action="store_true",
                        help="fit the emulated cluster's constants on --calibration-records, predict "
                             "--validation-records")
    parser.add_argument("--calibration-records", type=Path, nargs="+",
                        default=[Path(f"benchmarks/results/plan/bench_step_{size}/bench_step.json")
                                 for size in ("4x256", "6x384")])
    parser.add_argument("--validation-records", type=Path, nargs="+",
                        default=[Path("benchmarks/results/bench_step.json")])  # the headline run, 25M GPT
    parser.add_argument("--collective-rates", type=Path, default=None,
                        help="with --calibrate: benchmarks/collective_rates.py's JSON, to price each collective's "
                             "bytes at its own measured rate (default: one fitted rate for all)")
    parser.add_argument("--optimizer-rate", type=Path, default=None,
                        help="with --calibrate: benchmarks/optimizer_rate.py's JSON, the optimizer's cost per "
                             "parameter measured on the host instead of fitted")
    parser.add_argument("--paper", action="store_true",
                        help="the ZeRO++ paper's throughput figures and an H100 projection, predicted")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/plan"))
    parser.set_defaults(func=run_from_args)


def machine_from_args(args: argparse.Namespace) -> Any:
    from zeropp.tools.plan.cost import GBIT
    from zeropp.tools.plan.scale import H100_NODE, V100_DGX2

    machine = {"v100": V100_DGX2, "h100": H100_NODE}[args.machine]
    changes: dict[str, Any] = {"overlap": args.overlap}
    if args.gpus_per_node is not None:
        changes["ranks_per_node"] = args.gpus_per_node
    if args.inter_node_gbit is not None:
        changes["inter_node_bytes_per_s"] = 0.9 * args.inter_node_gbit * GBIT
    if args.intra_node_gbyte is not None:
        changes["intra_node_bytes_per_s"] = args.intra_node_gbyte * 1e9
    if args.tflops is not None:
        changes["flops_per_s"] = args.tflops * 1e12
    if args.memory_gb is not None:
        changes["memory_bytes"] = args.memory_gb * 1e9
    if args.host_device_gbyte is not None:
        changes["host_device_bytes_per_s"] = args.host_device_gbyte * 1e9
    for name, value in changes.items():
        if name != "overlap" and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if not 0 <= args.overlap <= 1:
        raise ValueError(f"--overlap={args.overlap} must be between 0 (none) and 1 (ideal)")
    return dataclasses.replace(machine, **changes)


def model_from_arg(text: str, context: int) -> Any:
    """The model shape ``--model`` names (``zeropp.tools.plan.model.meta_module``)."""
    from zeropp.tools.plan import model as model_shape

    module = meta_module(text, context)
    if text.startswith("hf:"):
        return model_shape.hf_module(module)
    config = module.config
    name = f"GPT-{text.partition(':')[2]}" if text.startswith("paper:") else None
    return model_shape.gpt(config, name)


def _explain(mode: str, model: str, context: int, topology: Any, precision: Any) -> Any:
    """``zeropp.explain`` of ``mode`` on the model ``--model`` names, built on the meta device."""
    from zeropp.setup.explain import explain

    if mode not in MODES:
        raise ValueError(f"--explain {mode!r} is not a mode; modes: {', '.join(MODES)}")
    config = MODES[mode].config(topology.ranks_per_node, param_dtype=precision.gather_dtype,
                                reduce_dtype=precision.reduce_dtype)
    return explain(meta_module(model, context), config, topology=topology)


def meta_module(text: str, context: int) -> nn.Module:
    """The model a ``--model`` argument names, built on the meta device: ``gpt:LAYERSxWIDTH``
    (zeropp's GPT-2 style model, vocabulary 50257), ``paper:18B`` / ``paper:138B`` (the ZeRO++
    paper's GPT sizes) or ``hf:CONFIG.json`` (a Hugging Face causal LM's config)."""
    from zeropp.tools.plan.scale import PAPER_MODELS

    kind, _, value = text.partition(":")
    dims = None
    if kind == "gpt":
        layers, _, width = value.partition("x")
        if layers.isdigit() and width.isdigit() and int(width) % 64 == 0:
            dims = {"num_layers": int(layers), "embed_dim": int(width), "num_heads": int(width) // 64}
    elif kind == "paper" and value in PAPER_MODELS:
        dims = PAPER_MODELS[value]
    elif kind == "hf" and Path(value).is_file():
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(value))
    if dims is None:
        raise ValueError(f"--model {text!r}: give gpt:LAYERSxWIDTH (width a multiple of 64), hf:<an existing "
                         f"config.json>, or paper:{'/'.join(PAPER_MODELS)}")
    with torch.device("meta"):
        return GPT(GPTConfig(vocab_size=50257, context_length=context, **dims))


def run_from_args(args: argparse.Namespace) -> int:
    """Run what the options ask for; a bad input is one line naming it, exit status 2."""
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"zeropp plan: {error}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.calibrate or args.paper:  # they plot
        from zeropp.tools.extras import require

        require("zeropp plan --calibrate / --paper", "tools", "matplotlib")
    if args.calibrate:
        from zeropp.tools.plan import emulated

        emulated.run(args.calibration_records, args.validation_records, args.out, args.collective_rates,
                     args.optimizer_rate)
        return 0
    if args.paper:
        from zeropp.tools.plan import report

        report.run(args.out)
        return 0
    from zeropp.setup.topology import Topology
    from zeropp.tools.plan.cost import Workload
    from zeropp.tools.plan.traffic import Precision

    machine = machine_from_args(args)
    if args.gpus < 1 or args.gpus % machine.ranks_per_node:
        raise ValueError(f"--gpus={args.gpus} must be a positive multiple of the GPUs per node "
                         f"({machine.ranks_per_node})")
    if args.batch_per_gpu < 1 or args.context < 1:
        raise ValueError(f"--batch-per-gpu={args.batch_per_gpu} and --context={args.context} must be positive")
    shape = model_from_arg(args.model, args.context)
    topology = Topology(num_nodes=args.gpus // machine.ranks_per_node, ranks_per_node=machine.ranks_per_node)
    precision = Precision(gather_dtype=torch.bfloat16, reduce_dtype=torch.float32 if args.machine == "h100"
                          else torch.float16)
    workload = Workload(batch_per_rank=args.batch_per_gpu, context_length=args.context, precision=precision,
                        activation_checkpointing=not args.no_checkpointing)
    if args.explain is not None:
        print(_explain(args.explain, args.model, args.context, topology, precision))
        return 0
    if args.recommend:
        from zeropp.tools.plan.recommend import recommend

        if args.offload != "none":
            raise ValueError(f"--recommend prices configurations without offload, not --offload={args.offload}; "
                             "drop --offload, or compare the modes with it (without --recommend)")
        print(recommend(shape, topology, workload, machine).reason)
        return 0
    from zeropp.tools.plan.table import format_record, plan_record

    if args.pipeline_parallel < 1:
        raise ValueError(f"--pipeline-parallel={args.pipeline_parallel} must be a positive degree (1: none)")
    if args.pipeline_parallel > 1:
        from zeropp.tools.plan.pipeline import format_pipeline, pipeline_record

        if args.offload != "none" or args.expert_parallel > 1:
            raise ValueError(f"--pipeline-parallel={args.pipeline_parallel} is priced without offload and expert "
                             f"parallel, not --offload={args.offload} --expert-parallel={args.expert_parallel}")
        record = pipeline_record(shape, topology, workload, machine, args.modes, args.pipeline_parallel,
                                 args.microbatch_size)
        print(json.dumps(record, indent=2) if args.json else format_pipeline(record))
        return 0
    if args.expert_parallel < 1:
        raise ValueError(f"--expert-parallel={args.expert_parallel} must be a positive degree (1: none)")
    record = plan_record(shape, topology, workload, machine, args.modes, args.offload, not args.no_pin_memory,
                         args.expert_parallel)
    print(json.dumps(record, indent=2) if args.json else format_record(record))
    return 0


