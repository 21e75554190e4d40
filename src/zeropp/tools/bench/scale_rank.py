"""One rank of a job of thousands, run alone on PyTorch's fake process group; ``zeropp bench
scale`` runs one such process per world size, rank and mode::

    python -m zeropp.tools.bench.scale_rank --world-size 4096 --rank 1024 --mode all --layers 2 --step --out r.json

``--device cuda`` puts the rank's shards, activations and kernels on the GPU (``zeropp check``
runs it so): its step then takes the device's real kernel times, still without a byte on a
network, and its peak is also read from the CUDA allocator. There the slice is allocated whole
on the GPU before sharding (``zeropp.shard`` takes its mesh's device from the parameters, and a
meta model's would be the CPU), so set-up there is not the meta-device set-up of a CPU run.

[Note: one real rank of a large job]
``init_process_group("fake", ...)`` makes this process rank ``rank`` of ``world_size`` ranks
that do not exist: every collective returns at once (gathers tile the local input, reductions
leave it as it is, all-to-alls fill arbitrary bytes), but process groups, device meshes, FSDP2's
layouts, every tensor the rank allocates and every line of Python it runs are those of the real
rank. So set-up time, group counts, shard sizes, memory and zeropp's own Python time are real
figures of one rank at that scale; step times are not a cluster's (no byte moves), and no number
the model computes means anything.

The model is built on the meta device and materialised as this rank's shards only, as torchtitan
does: ``zeropp.shard`` on the meta model, ``to_empty(device="cpu")``, then initialisation. Its
units are torchtitan's for Llama: every decoder layer, the token embedding, the final norm and
the output head (the root keeps no parameter of its own).

[Note: measured memory]
``FSDPMemTracker`` (FSDP2's memory tracker, a dispatch mode) counts every tensor storage the
step creates or holds by category: sharded parameters, optimizer state, sharded and unsharded
gradients, activations, temporaries (what backward creates: gradients of activations, the
weights gathered again, reduce-scatter buffers), all-gather outputs. Its peak is the largest sum
of live storages during the step: tensor memory, without the allocator's slack or the
process's code and libraries (the peak resident set size, also recorded, has both). The step it
tracks is a steady one: the optimizer's state is created first by one update on zero gradients
(no forward), so the tracked forward and backward run beside that state, as every later step's do.

The tracker as torch ships it holds one tensor too many: its wrapper of a unit's post-backward
tags the unit's unsharded gradients in a loop whose variable still refers to the last one while
the reduce-scatter runs, so that gradient outlives FSDP2's release of it (for a unit of one
parameter, an embedding or a head, the whole unit's gradient). ``UnitMemoryTracker`` tags them
in a function of its own, whose frame is gone when the reduce-scatter starts.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeropp.config import ZeroPPConfig

MODEL_SHAPES: dict[str, dict[str, int]] = {
    "llama3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "vocab_size": 128256},
    "narrow": {"hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vocab_size": 1024},
}
"""Llama-3-8B's shape (32 layers; rope theta 500000, untied embedding and head), and a narrow
Llama for tests: the same parameter list, small enough that a step takes milliseconds."""

FULL_LAYERS = {"llama3-8b": 32, "narrow": 4}
RANKS_PER_NODE = 8


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One run: a rank of a world, a mode, a model."""

    world_size: int
    rank: int
    mode: str
    """A name of ``zeropp.tools.modes.MODES`` trained by ``zeropp.shard``."""
    model: str = "llama3-8b"
    """A key of ``MODEL_SHAPES``."""
    num_layers: int = 2
    step: bool = True
    """Train two steps (one tracked for memory, one profiled); otherwise set-up and the optimizer's
    state only."""
    batch_size: int = 1
    context_length: int = 16
    ranks_per_node: int = RANKS_PER_NODE
    device: str = "cpu"
    """Where the rank's shards, activations and kernels live: "cpu" or "cuda"."""
    timed_steps: int = 0
    """Steps after the profiled one, timed with neither tracker nor profiler (their median is
    ``plain_step_s``)."""
    grad_slice_bytes: int | None = ZeroPPConfig.grad_slice_bytes
    """qgZ's slice bound (``ZeroPPConfig.grad_slice_bytes``; None: one slice)."""


def llama_config(model: str, num_layers: int) -> Any:
    """A ``transformers.LlamaConfig`` of ``MODEL_SHAPES[model]`` with ``num_layers`` layers."""
    from transformers import LlamaConfig

    return LlamaConfig(**MODEL_SHAPES[model], num_hidden_layers=num_layers, rope_theta=500000.0,
                       max_position_embeddings=8192, tie_word_embeddings=False)


def build_meta_llama(model: str, num_layers: int) -> tuple[nn.Module, list[nn.Module]]:
    """The Llama on the meta device, and its units in torchtitan's choice (see the module Note)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        llama = LlamaForCausalLM(llama_config(model, num_layers))
    inner = llama.model
    return llama, [*inner.layers, inner.embed_tokens, inner.norm, llama.lm_head]


@torch.no_grad()
def materialise(llama: nn.Module, device: str = "cpu") -> None:
    """Allocate this rank's shards on ``device`` and initialise them (matrices N(0, 0.02), norms
    1); the rotary frequencies, a buffer, are computed again."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    llama.to_empty(device=device)
    for parameter in llama.parameters():
        parameter.normal_(0.0, 0.02) if parameter.dim() > 1 else parameter.fill_(1.0)
    llama.model.rotary_emb = LlamaRotaryEmbedding(config=llama.config).to(device)


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def layout(llama: nn.Module) -> dict[str, Any]:
    """This rank's shard of every parameter: its rows, and the parameters it holds none of."""
    rows = {name: tuple(p.to_local().shape)[0] if p.dim() else 1 for name, p in llama.named_parameters()}
    return {"local_rows": rows, "empty": [name for name, n in rows.items() if n == 0],
            "local_numel": sum(p.to_local().numel() for p in llama.parameters())}


def create_optimizer_state(optimizer: torch.optim.Optimizer, parameters: list[nn.Parameter]) -> None:
    """One update on zero gradients: AdamW creates its state, nothing is gathered."""
    for parameter in parameters:
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def peak_rss_reset() -> None:
    """Start a new peak of the resident set size (Linux: ``clear_refs`` 5 resets VmHWM)."""
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_tracker(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """``FSDPMemTracker`` on ``model``, without its hold on the last unsharded gradient of the
    unit in its reduce-scatter ([Note: measured memory])."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType, _FSDPState

    from zeropp.fsdp.access import unit_parameters, unsharded_gradients

    class UnitMemoryTracker(FSDPMemTracker):
        def _fsdp_param_group_post_backward(self, unit: Any, post_backward: Any) -> Any:
            def tracked(*args: Any, **kwargs: Any) -> None:
                self._tag(unsharded_gradients(unit), _FSDPRefType.UNSHARDED_GRAD, True)
                self._fsdp_state = _FSDPState.POST_BW
                post_backward(*args, **kwargs)
                self._tag([p.grad for p in unit_parameters(unit) if p.grad is not None], _FSDPRefType.SHARDED_GRAD)

            return tracked

        def _tag(self, tensors: list[torch.Tensor], kind: Any, existing: bool = False) -> None:
            for tensor in tensors:
                self._update_and_maybe_create_winfos(tensor, kind, update_existing=existing)

    return UnitMemoryTracker(model, optimizer)


class Steps:
    """The training steps of one run: forward, backward, AdamW."""

    def __init__(self, llama: nn.Module, config: RunConfig) -> None:
        self.llama = llama
        self.optimizer = torch.optim.AdamW(llama.parameters(), lr=1e-4)
        generator = torch.Generator().manual_seed(0)
        self.device = torch.device(config.device)
        self.tokens = torch.randint(0, llama.config.vocab_size, (config.batch_size, config.context_length),
                                    generator=generator).to(self.device)
        self.secondary_copy_bytes = 0

    def synchronize(self) -> None:
        """Wait for the device's queued kernels (a CUDA step returns before its kernels end)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> None:
        from zeropp.techniques.hpz import held_secondary_copy_bytes

        loss = self.llama(input_ids=self.tokens, labels=self.tokens).loss
        self.secondary_copy_bytes = held_secondary_copy_bytes(self.llama)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def tracked_step(self) -> dict[str, Any]:
        """One step under FSDP2's memory tracker: its peak by category ([Note: measured memory]),
        the peak RSS, and the hpZ secondary copy held at the end of forward."""
        tracker = memory_tracker(self.llama, self.optimizer)
        tracker.track_inputs((self.tokens,))
        peak_rss_reset()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        started = time.perf_counter()
        with tracker:
            self.step()
            self.synchronize()
        elapsed = time.perf_counter() - started
        peaks = tracker.get_tracker_snapshot("peak")
        peak = max((p for device, p in peaks.items() if device.type == self.device.type), key=lambda p: p["Total"])
        cuda = {"cuda_peak_bytes": torch.cuda.max_memory_allocated(self.device)} if self.device.type == "cuda" else {}
        return {"tracked_step_s": elapsed, "peak_bytes": peak["Total"],
                "peak_by_category": {str(getattr(k, "value", k)): v for k, v in peak.items() if k != "Total"},
                "peak_rss_bytes": peak_rss_bytes(), "secondary_copy_bytes": self.secondary_copy_bytes, **cuda}

    def profiled_step(self) -> dict[str, Any]:
        """One step under cProfile: its time, and the time spent in zeropp's own frames (the
        C codec's calls apart: ctypes calls show in their caller's own time)."""
        import zeropp

        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        self.step()
        self.synchronize()
        profile.disable()
        elapsed = time.perf_counter() - started
        package = os.path.dirname(zeropp.__file__) + os.sep
        own = {"python_s": 0.0, "native_s": 0.0, "calls": 0}
        top: list[tuple[float, str]] = []
        for (filename, line, function), (_, calls, own_s, _, _) in pstats.Stats(profile).stats.items():
            if not filename.startswith(package) or filename.startswith(os.path.join(package, "tools", "bench")):
                continue
            key = "native_s" if filename.endswith("native.py") else "python_s"
            own[key] += own_s
            own["calls"] += calls
            top.append((own_s, f"{os.path.relpath(filename, package)}:{line}({function})"))
        return {"step_s": elapsed, "zeropp_python_s": own["python_s"], "zeropp_native_s": own["native_s"],
                "zeropp_calls": own["calls"], "zeropp_top": [[name, s] for s, name in sorted(top, reverse=True)[:8]]}

    def timed_steps(self, num_steps: int) -> dict[str, Any]:
        """``num_steps`` steps with neither tracker nor profiler: their median time, the step's
        own pace on this device."""
        times = []
        for _ in range(num_steps):
            self.synchronize()
            started = time.perf_counter()
            self.step()
            self.synchronize()
            times.append(time.perf_counter() - started)
        return {"plain_step_s": statistics.median(times), "plain_steps_s": times}


def run(config: RunConfig) -> dict[str, Any]:
    """Set up ``config``'s rank on the fake process group, and train it when asked."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import zeropp
    from zeropp.fsdp.access import counting_new_groups, num_process_groups
    from zeropp.techniques.hpz import keep_decoded_secondary_copies
    from zeropp.tools.modes import MODES

    dist.init_process_group("fake", rank=config.rank, world_size=config.world_size, store=FakeStore())
    topology = zeropp.Topology.from_world(config.world_size, config.ranks_per_node)
    llama, units = build_meta_llama(config.model, config.num_layers)
    if config.device != "cpu":  # zeropp.shard takes the mesh's device from the parameters ("cpu" for meta ones):
        llama.to_empty(device=config.device)  # the full slice, uninitialised; sharding keeps this rank's shards
    mode = MODES[config.mode].config(config.ranks_per_node, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                     grad_slice_bytes=config.grad_slice_bytes)
    with counting_new_groups() as new_groups:
        started = time.perf_counter()
        zeropp.shard(llama, mode, topology=topology, units=units)
        if MODES[config.mode].decoded_secondary_copy:
            keep_decoded_secondary_copies(llama)
        shard_s = time.perf_counter() - started
        record: dict[str, Any] = {"config": asdict(config), "shard_s": shard_s, "new_group_calls": new_groups[0],
                                  "process_groups": num_process_groups(), "num_units": len(units) + 1}
        materialise(llama, config.device)
        record["setup_s"] = time.perf_counter() - started
        record["layout"] = layout(llama)
        steps = Steps(llama, config)
        parameters = list(llama.parameters())
        create_optimizer_state(steps.optimizer, parameters)
        optimizer_tensors = [t for state in steps.optimizer.state.values() for t in state.values() if t.dim()]
        record["sharded_bytes"] = {"parameters": storage_bytes(parameters),
                                   "optimizer": storage_bytes(optimizer_tensors)}
        if config.step:
            record.update(steps.tracked_step())
            record.update(steps.profiled_step())
            if config.timed_steps:
                record.update(steps.timed_steps(config.timed_steps))
        record["new_group_calls_at_end"] = new_groups[0]
    record["process_groups_at_end"] = num_process_groups()
    dist.destroy_process_group()
    return record


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, kind in (("world-size", int), ("rank", int), ("mode", str), ("model", str), ("layers", int),
                       ("context-length", int), ("device", str), ("timed-steps", int)):
        parser.add_argument(f"--{name}", type=kind, required=name in ("world-size", "rank", "mode"))
    parser.add_argument("--grad-slice-bytes", type=lambda text: None if text == "none" else int(text),
                        default=ZeroPPConfig.grad_slice_bytes, help="qgZ's slice bound, or 'none' (one slice)")
    parser.add_argument("--step", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    given = {"model": args.model, "num_layers": args.layers, "context_length": args.context_length,
             "device": args.device, "timed_steps": args.timed_steps}
    config = RunConfig(world_size=args.world_size, rank=args.rank, mode=args.mode, step=args.step,
                       grad_slice_bytes=args.grad_slice_bytes,
                       **{name: value for name, value in given.items() if value is not None})
    args.out.write_text(json.dumps(run(config), indent=1))


if __name__ == "__main__":
    main()
