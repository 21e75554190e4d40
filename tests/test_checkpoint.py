"""Engine checkpoints through DCP: exact round trip, resharding 4 -> 2 ranks, ZeRO++ on -> off,
crashes during a save, corrupted and malicious files, offline consolidation, and a SIGKILLed
rank resumed by torchrun."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.utils import CheckpointException

import zeropp
from distributed import run_distributed
from models import global_batch, make_model, rows
from zeropp import checkpoint
from zeropp.checkpoint import CheckpointError
from zeropp.checkpoint import tools as checkpoint_tools
from zeropp.tools.cli import build_parser

TWO_BY_TWO = {"ZEROPP_RANKS_PER_NODE": "2"}
GLOBAL_BATCH = 8
ZEROPP_ON = {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
ZEROPP_EF = {**ZEROPP_ON, "zeropp": {"error_feedback": True}}


def _config(zero: dict) -> dict:
    return {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, **zero}, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}},
            "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 6, "warmup_num_steps": 2,
                                                               "warmup_type": "linear"}}}


def _engine(seed: int, zero: dict) -> zeropp.ZeroPPEngine:
    return zeropp.initialize(model=make_model("tied", seed=seed), config=_config(zero))[0]


def _train(engine: zeropp.ZeroPPEngine, first: int, last: int, rank: int, world_size: int) -> None:
    """Global steps first..last-1 on the same global batches whatever the world size: this rank's
    rows, split into the engine's micro-batches."""
    accumulation = engine.gradient_accumulation_steps()
    for step in range(first, last):
        x, y = global_batch(step, GLOBAL_BATCH)
        for micro in range(accumulation):
            xm, ym = (rows(rows(t, rank, world_size), micro, accumulation) for t in (x, y))
            engine.backward(engine(xm, ym)[1])
            engine.step()


def _full_params(engine: zeropp.ZeroPPEngine) -> dict[str, torch.Tensor]:
    return {name: p.detach().full_tensor().clone() for name, p in engine.module.named_parameters()}


def _full_optimizer(engine: zeropp.ZeroPPEngine) -> dict[str, object]:
    """The optimizer state gathered to rank 0, flattened to {"fqn.key": value} (empty elsewhere)."""
    state = get_optimizer_state_dict(engine.module, engine.optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    flat = {f"{fqn}.{key}": value.clone() for fqn, entry in state.get("state", {}).items()
            for key, value in entry.items()}  # clone: "step" comes back as the live tensor
    flat.update({f"group.{key}": value for group in state.get("param_groups", [])
                 for key, value in group.items() if key != "params"})
    return flat


def _differences(a: dict, b: dict) -> list[str]:
    """Keys whose values differ (or exist on one side only)."""
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not (
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]))


def _same(a: dict, b: dict) -> bool:
    return not _differences(a, b)


def _pack(result: dict) -> bytes:
    """Tensors cannot cross the harness's queue reliably (torch shares them by file descriptor,
    gone once the rank exits): send the result as torch.save bytes."""
    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


def _unpack(results: list[bytes]) -> list[dict]:
    return [torch.load(io.BytesIO(data), weights_only=True) for data in results]


def _draw_rng() -> list[float]:
    return [*torch.rand(2).tolist(), random.random(), float(numpy.random.rand())]


def _save_with_failing_writer(engine: zeropp.ZeroPPEngine, directory: Path, rank: int) -> dict:
    """Rank 1's DCP writer writes its data files, then fails (a disk error mid-save)."""
    original = FileSystemWriter.write_data
    written: list[str] = []

    def write_then_fail(self, plan, planner):  # type: ignore[no-untyped-def]
        original(self, plan, planner).wait()
        written.extend(sorted(p.name for p in Path(self.path).iterdir()))
        raise OSError("injected: disk failure after writing this rank's data")

    if rank == 1:
        FileSystemWriter.write_data = write_then_fail
    try:
        engine.save_checkpoint(directory)
        return {"error": None}
    except CheckpointError as error:
        return {"error": str(error), "written": written}
    finally:
        FileSystemWriter.write_data = original


def _save_with_failing_latest(engine: zeropp.ZeroPPEngine, directory: Path, rank: int) -> dict:
    """Rank 0 dies (raises) just before ``latest`` would be replaced."""
    original = os.replace

    def replace(source, destination):  # type: ignore[no-untyped-def]
        if Path(destination).name == checkpoint.LATEST:
            raise OSError("injected: crash before 'latest' was replaced")
        return original(source, destination)

    if rank == 0:
        os.replace = replace
    try:
        engine.save_checkpoint(directory)
        return {"error": None}
    except CheckpointError as error:
        return {"error": str(error)}
    finally:
        os.replace = original


def _four_rank_run(rank: int, world_size: int, root: str) -> dict:
    root_path = Path(root)
    engine = _engine(0, {})
    _train(engine, 0, 2, rank, world_size)
    engine.save_checkpoint(root_path / "plain", client_state={"data_position": 2})
    out: dict = {"saved_params": _full_params(engine), "saved_optimizer": _full_optimizer(engine),
                 "saved_lr": engine.get_lr(), "rng_after_save": _draw_rng()}
    _train(engine, 2, 3, rank, world_size)
    out["crash_writer"] = _save_with_failing_writer(engine, root_path / "plain", rank)
    out["latest_after_crash_writer"] = checkpoint.read_latest(root_path / "plain")
    out["crash_latest"] = _save_with_failing_latest(engine, root_path / "plain", rank)
    _train(engine, 3, 4, rank, world_size)
    out["params_step4"] = _full_params(engine)

    fresh = _engine(1, {})  # other initial weights: the load must overwrite everything
    path, client_state = fresh.load_checkpoint(root_path / "plain")
    out["round_trip"] = {
        "path": str(path), "client_state": client_state, "global_steps": fresh.global_steps,
        "micro_steps": fresh.micro_steps, "lr": fresh.get_lr(), "rng": _draw_rng(),
        "params": _differences(_full_params(fresh), out["saved_params"]),
        "optimizer": _differences(_full_optimizer(fresh), out["saved_optimizer"])}

    with_zeropp = _engine(0, ZEROPP_ON)
    _train(with_zeropp, 0, 2, rank, world_size)
    with_zeropp.save_checkpoint(root_path / "zeropp")
    out["zeropp_params"] = _full_params(with_zeropp)
    out["zeropp_optimizer"] = _full_optimizer(with_zeropp)
    out["load_warnings"] = {name: _load_warnings(_engine(0, zero), root_path / "zeropp")
                            for name, zero in (("plain", {}), ("error_feedback", ZEROPP_EF))}
    return _pack(out)



def _load_warnings(engine: zeropp.ZeroPPEngine, directory: Path) -> list[str]:
    """What zeropp's logger warns while ``engine`` loads ``directory``."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("zeropp")
    logger.addHandler(handler)
    try:
        engine.load_checkpoint(directory)
    finally:
        logger.removeHandler(handler)
    return [record.getMessage() for record in records]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """One 4-rank job (2 nodes x 2): train, save, crash two saves, round-trip, and save a
    checkpoint with qwZ + hpZ + qgZ on."""
    root = tmp_path_factory.mktemp("ckpt")
    return root, _unpack(run_distributed(_four_rank_run, 4, str(root), env=TWO_BY_TWO, timeout=300))


@pytest.mark.slow
def test_round_trip_on_four_ranks_restores_everything(four_ranks: tuple[Path, list[dict]]) -> None:
    """A fresh engine with other weights loads the step-2 checkpoint: parameters and AdamW state
    bit-identical to the saved ones, steps, schedule, client state and every rank's RNG
    streams (torch, Python, NumPy) continue exactly where they were at the save."""
    root, results = four_ranks
    for rank, r in enumerate(results):
        trip = r["round_trip"]
        assert trip["path"] == str(root / "plain" / "global_step2")
        assert trip["client_state"] == {"data_position": 2}
        assert (trip["global_steps"], trip["micro_steps"]) == (2, 2)
        assert trip["lr"] == r["saved_lr"]
        assert trip["rng"] == r["rng_after_save"]
        assert trip["params"] == [] and trip["optimizer"] == [], f"rank {rank}"
    assert len(results[0]["saved_optimizer"]) > 10  # exp_avg, exp_avg_sq, step per parameter


@pytest.mark.slow
def test_load_says_error_feedback_restarts_from_zero(four_ranks: tuple[Path, list[dict]]) -> None:
    """qgZ's error-feedback residuals are not in checkpoints: loading into an engine that uses
    them says so (the resumed run is not bit-identical); loading without them says nothing."""
    _, results = four_ranks
    for r in results:
        assert r["load_warnings"]["plain"] == []
        [warning] = r["load_warnings"]["error_feedback"]
        assert "error-feedback residuals are not saved" in warning and "global_step2" in warning


@pytest.mark.slow
def test_crash_during_save_keeps_previous_checkpoint(four_ranks: tuple[Path, list[dict]]) -> None:
    """Rank 1's writer fails after writing its files: every rank raises CheckpointError (none
    hangs), the staging directory is gone, ``latest`` still names step 2. Rank 0 failing just
    before replacing ``latest``: the step-3 directory is complete but ``latest`` still names step
    2. The round-trip test loads that step-2 checkpoint through ``latest`` after both crashes."""
    root, results = four_ranks
    for r in results:
        assert "injected: disk failure" in r["crash_writer"]["error"]
        assert r["latest_after_crash_writer"] == "global_step2"
        assert "injected: crash before 'latest'" in r["crash_latest"]["error"]
    assert any(name.endswith(".distcp") for name in results[1]["crash_writer"]["written"])
    plain = root / "plain"
    assert checkpoint.read_latest(plain) == "global_step2"
    assert not (plain / ".tmp-global_step3").exists()
    checkpoint.verify(plain / "global_step2")
    checkpoint.verify(plain / "global_step3")  # complete, just never made `latest`


def _two_rank_resume(rank: int, world_size: int, root: str, corrupted: dict[str, str]) -> dict:
    root_path = Path(root)
    engine = _engine(1, {})
    resumed = engine.resume_if_possible(root_path / "plain")
    out: dict = {"resumed": resumed, "global_steps": engine.global_steps,
                 "accumulation": engine.gradient_accumulation_steps()}
    _train(engine, engine.global_steps, 4, rank, world_size)
    out["params_step4"] = _full_params(engine)

    without_zeropp = _engine(1, {})
    without_zeropp.load_checkpoint(root_path / "zeropp")
    out["zeropp_params"] = _full_params(without_zeropp)
    out["zeropp_optimizer"] = _full_optimizer(without_zeropp)
    before = _full_params(without_zeropp)
    out["corrupted"] = {}
    for name, directory in corrupted.items():
        try:
            without_zeropp.load_checkpoint(directory)
            out["corrupted"][name] = None
        except CheckpointError as error:
            out["corrupted"][name] = str(error)
    out["untouched_by_refused_loads"] = _same(_full_params(without_zeropp), before)
    _train(without_zeropp, 2, 3, rank, world_size)
    out["finite_after_step"] = all(bool(p.isfinite().all()) for p in _full_params(without_zeropp).values())
    return _pack(out)


def _corrupt_copies(plain: Path, target: Path) -> dict[str, tuple[str, str]]:
    """Copies of the step-2 checkpoint under ``target/<name>``, each damaged one way:
    name -> (the damaged file's name, a phrase the error must contain)."""
    cases = {}

    def copy(name: str) -> Path:
        destination = target / name
        shutil.copytree(plain, destination, ignore=shutil.ignore_patterns("global_step3", ".tmp-*"))
        return destination / "global_step2"

    step = copy("truncated_shard")
    shard = sorted(step.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    cases["truncated_shard"] = (shard.name, "truncated")
    step = copy("garbled_metadata")
    data = bytearray((step / ".metadata").read_bytes())
    data[len(data) // 2: len(data) // 2 + 16] = b"\xff" * 16
    (step / ".metadata").write_bytes(bytes(data))
    cases["garbled_metadata"] = (".metadata", "corrupted")
    step = copy("missing_file")
    victim = sorted(step.glob("*.distcp"))[-1]
    victim.unlink()
    cases["missing_file"] = (victim.name, "missing")
    step = copy("garbled_manifest")
    (step / "zeropp.json").write_text('{"format": "zeropp-checkpoint", "vers')
    cases["garbled_manifest"] = ("zeropp.json", "not readable JSON")
    step = copy("missing_manifest")
    (step / "zeropp.json").unlink()
    cases["missing_manifest"] = ("zeropp.json", "is missing")
    return cases


@pytest.fixture(scope="module")
def two_ranks(four_ranks: tuple[Path, list[dict]], tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[dict[str, tuple[str, str]], list[dict], Path]:
    """One 2-rank job: resume the 4-rank run, load the ZeRO++ checkpoint with ZeRO++ off, and
    try every corrupted copy."""
    root, _ = four_ranks
    target = tmp_path_factory.mktemp("corrupt")
    cases = _corrupt_copies(root / "plain", target)
    directories = {name: str(target / name) for name in cases}
    return cases, _unpack(run_distributed(_two_rank_resume, 2, str(root), directories, timeout=300)), target


def test_reshard_four_to_two_ranks_continues_like_uninterrupted_run(
        four_ranks: tuple[Path, list[dict]], two_ranks: tuple[dict, list[dict], Path]) -> None:
    """Saved at step 2 on 4 ranks (1 micro-batch each), resumed on 2 ranks (2 micro-batches each,
    the same global batches), trained to step 4: equal to the uninterrupted 4-rank run within
    fp32 rounding, 1e-6 relative per tensor (the gradient sums differ only in order)."""
    _, four = four_ranks
    _, two, _ = two_ranks
    reference = four[0]["params_step4"]
    for r in two:
        assert r["resumed"] and r["global_steps"] == 2 and r["accumulation"] == 2
        for name, value in r["params_step4"].items():
            error = ((value - reference[name]).norm() / reference[name].norm()).item()
            assert error <= 1e-6, (name, error)
    moved = max(((reference[n] - four[0]["saved_params"][n]).norm() / reference[n].norm()).item()
                for n in reference)
    assert moved > 1e-3, "steps 3-4 barely changed the parameters; the comparison would prove little"


def test_zeropp_checkpoint_loads_with_zeropp_off(
        four_ranks: tuple[Path, list[dict]], two_ranks: tuple[dict, list[dict], Path]) -> None:
    """Saved with qwZ + hpZ + qgZ on 4 ranks, loaded on 2 ranks with none of them: the
    parameters and AdamW state are bit-identical (the state dict is the full-precision sharded
    parameters; quantization only ever touches what is sent), and training continues."""
    _, four = four_ranks
    _, two, _ = two_ranks
    assert _same(two[0]["zeropp_params"], four[0]["zeropp_params"])
    assert _same(two[0]["zeropp_optimizer"], four[0]["zeropp_optimizer"])
    assert all(r["finite_after_step"] for r in two)


def test_corrupted_checkpoints_are_refused_on_every_rank(two_ranks: tuple[dict, list[dict], Path]) -> None:
    """Truncated shard, garbled .metadata, deleted data file, garbled or missing manifest: every
    rank raises CheckpointError naming the damaged file and the problem, before anything is
    read into the model (its parameters are unchanged)."""
    cases, results, _ = two_ranks
    for r in results:
        for name, (file_name, phrase) in cases.items():
            message = r["corrupted"][name]
            assert message is not None, f"{name} was loaded"
            assert file_name in message and phrase in message, (name, message)
        assert r["untouched_by_refused_loads"]


@pytest.mark.parametrize("name", ["truncated_shard", "garbled_metadata", "missing_file", "garbled_manifest",
                                  "missing_manifest"])
def test_verify_refuses_corruption_without_process_group(name: str, two_ranks: tuple[dict, list[dict], Path]
                                                         ) -> None:
    cases, _, target = two_ranks
    file_name, phrase = cases[name]
    with pytest.raises(CheckpointError, match=phrase) as error:
        checkpoint.verify(target / name / "global_step2")
    assert file_name in str(error.value)


class _Payload:
    """A pickle that runs a shell command when unpickled: what a forged checkpoint could hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def _forge(source: Path, target: Path, metadata: object, extra: dict[str, bytes]) -> Path:
    """A copy of ``source`` with new metadata and extra files, the manifest re-hashed to match
    (an attacker can rewrite everything)."""
    shutil.copytree(source, target)
    for name, data in extra.items():
        (target / name).write_bytes(data)
    (target / ".metadata").write_bytes(pickle.dumps(metadata))
    manifest = json.loads((target / "zeropp.json").read_text())
    for name in [".metadata", *extra]:
        manifest["files"][name] = {"bytes": (target / name).stat().st_size,
                                   "sha256": checkpoint._sha256(target / name)}
    (target / "zeropp.json").write_text(json.dumps(manifest))
    return target


@pytest.mark.slow
def test_forged_checkpoint_never_runs_code(four_ranks: tuple[Path, list[dict]], tmp_path: Path) -> None:
    """A forged .metadata that is a pickle calling os.system, and a forged non-tensor entry (the
    optimizer's param_groups) holding the same: zeropp refuses both without running them.
    Stock DCP (FileSystemReader + DefaultLoadPlanner) does run the second: the payload is real."""
    root, _ = four_ranks
    source = root / "zeropp" / "global_step2"
    marker = tmp_path / "pwned"
    evil_metadata = _forge(source, tmp_path / "evil_metadata", _Payload(marker), {})
    with pytest.raises(CheckpointError, match="not allowed in DCP metadata"):
        checkpoint.verify(evil_metadata)
    assert not marker.exists()

    metadata = checkpoint.read_dcp_metadata(source)
    key = next(k for k in metadata.storage_data if k.fqn.startswith("optimizer.param_groups"))
    payload = io.BytesIO()
    torch.save(_Payload(marker), payload)
    metadata.storage_data[key] = _StorageInfo("__evil.distcp", 0, len(payload.getvalue()))
    evil_entry = _forge(source, tmp_path / "evil_entry", metadata, {"__evil.distcp": payload.getvalue()})
    checkpoint.verify(evil_entry)  # structurally valid: the defence is in how entries are read
    with pytest.raises(CheckpointException, match="Weights only load failed"):  # a BaseException
        _load_state_dict({}, storage_reader=checkpoint.SafeReader(evil_entry),
                         planner=checkpoint.SafeEmptyStateDictLoadPlanner(), no_dist=True)
    assert not marker.exists()
    _load_state_dict({}, storage_reader=FileSystemReader(evil_entry), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    assert marker.exists(), "stock DCP did not run the payload: the test proves nothing"


@pytest.mark.slow
def test_consolidate_and_inspect_offline(four_ranks: tuple[Path, list[dict]], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Without a process group: ``consolidate`` writes the ZeRO++ run's full parameters to one
    safetensors file, bit-identical to the gathered parameters; ``inspect`` and the CLI
    commands list the checkpoint's entries."""
    from safetensors.torch import load_file

    root, results = four_ranks
    out = checkpoint_tools.consolidate(root / "zeropp", tmp_path / "model.safetensors")
    tensors = load_file(str(out))
    expected = results[0]["zeropp_params"]
    assert set(expected) <= set(tensors)
    assert all(torch.equal(tensors[name], value) for name, value in expected.items())

    report = checkpoint_tools.inspect(root / "zeropp")
    assert report["saved_world_size"] == 4 and report["engine"]["global_steps"] == 2
    assert report["entries"]["model.embed.weight"]["shape"] == list(expected["embed.weight"].shape)

    parser = build_parser(["checkpoint"])
    args = parser.parse_args(["checkpoint", "inspect", str(root / "plain")])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "global_step2" in printed and "model.embed.weight" in printed
    args = parser.parse_args(["checkpoint", "consolidate", str(root / "plain"), str(tmp_path / "b.safetensors"),
                              "--tag", "global_step3"])
    assert args.func(args) == 0 and (tmp_path / "b.safetensors").is_file()
    with pytest.raises(CheckpointError, match="latest is missing"):
        checkpoint_tools.consolidate(tmp_path / "nowhere", tmp_path / "c.safetensors")


def _torchrun(ckpt: Path, out: Path, kill_at: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", str(Path(__file__).with_name("resume_job.py")), "--ckpt", str(ckpt),
               "--out", str(out), "--steps", "6", "--every", "2", "--kill-at", str(kill_at)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("ZEROPP_RANKS_PER_NODE", None)
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_sigkilled_rank_resumes_exactly_under_torchrun(tmp_path: Path) -> None:
    """tests/resume_job.py on 2 ranks (qwZ, AdamW, WarmupLR, clipping, dropout), checkpointing
    every 2 steps: rank 1 SIGKILLs itself after step 5, torchrun (--max-restarts 1) restarts both
    ranks, they resume from step 4 and finish step 6. The final parameters equal an
    uninterrupted run's bit for bit (dropout makes this depend on the restored RNG states)."""
    killed = _torchrun(tmp_path / "killed", tmp_path / "killed.pt", kill_at=5)
    clean = _torchrun(tmp_path / "clean", tmp_path / "clean.pt", kill_at=0)
    logs = {name: process.communicate(timeout=240)[0] for name, process in (("killed", killed), ("clean", clean))}
    assert killed.returncode == 0 and clean.returncode == 0, logs["killed"][-3000:] + logs["clean"][-3000:]
    assert (tmp_path / "killed" / "killed").exists(), "the rank was never killed"
    resumed, uninterrupted = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("killed", "clean"))
    assert resumed["restarts"] == 1 and uninterrupted["restarts"] == 0
    assert resumed["global_steps"] == uninterrupted["global_steps"] == 6
    assert resumed["params"].keys() == uninterrupted["params"].keys()
    assert all(torch.equal(resumed["params"][k], uninterrupted["params"][k]) for k in resumed["params"])
