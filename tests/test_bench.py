"""The benchmark harness: the worker's record on 4 local gloo ranks (2 nodes x 2 declared), gloo's
wire model against the per-op facts measured on the emulated cluster, and, where network
namespaces are permitted, one tiny job on the cluster whose wire bytes must match the model."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from distributed import run_distributed
from zeropp.fsdp.ledger import CommLedger, GroupInfo, Op
from zeropp.setup.topology import Topology
from zeropp.tools.bench import comm
from zeropp.tools.bench.worker import WorkerConfig, build_parser, run
from zeropp.tools.cluster import check_support
from zeropp.tools.cluster.netns import list_namespaces

TINY = WorkerConfig(modes=("zero3", "all"), warmup_steps=0, steps=1, batch_size=8, context_length=16,
                    num_layers=1, embed_dim=64, num_heads=2)
TOPOLOGY = Topology(num_nodes=2, ranks_per_node=2)


def test_worker_config_round_trips_through_the_command_line() -> None:
    config = replace(TINY, wire=True, modes=("hsdp", "qgz"))
    args = vars(build_parser().parse_args(["--out", "r.json", *config.worker_args()]))
    args.pop("out")
    assert WorkerConfig(**args) == config


@pytest.mark.parametrize("changes,message", [
    ({"modes": ("zero3", "zero4")}, "modes=\\['zero3', 'zero4'\\] must be distinct names from.*unknown: \\['zero4'\\]"),
    ({"modes": ()}, "modes=\\[\\] must be distinct names"),
    ({"reduce_dtype": "float16"}, "reduce_dtype='float16' is not one of \\['bfloat16', 'float32'\\]"),
    ({"steps": 0}, "steps=0 must be >= 1"),
])
def test_worker_config_rejects(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(TINY, **changes)


def _run_tiny(rank: int, world_size: int) -> dict | None:
    # a warm-up step first: the timed step's window then holds one set of the first units' gathers
    # (those the warm-up's optimizer step started, ``overlap``), as every step after the first does
    return run(replace(TINY, unit_comm_calls=2, warmup_steps=1))


@pytest.mark.slow
def test_worker_record_on_local_ranks() -> None:
    record, *others = run_distributed(_run_tiny, 4, env={"ZEROPP_RANKS_PER_NODE": "2"})
    assert others == [None, None, None]
    num_params = record["num_parameters"]
    assert record["topology"] == {"num_nodes": 2, "ranks_per_node": 2, "world_size": 4}
    assert len(record["peak_rss_mb"]) == 4 and min(record["peak_rss_mb"]) > 100
    zero3, every = record["modes"]["zero3"], record["modes"]["all"]
    for result in (zero3, every):
        assert len(result["step_times_s"]) == 1 and result["median_step_s"] > 0
        assert result["wire_per_step"] is None
        assert len(result["ledger_per_step"]) == 4
    # Same weights and batch: the first loss is the initial loss, near ln(vocab), in both modes;
    # qwZ's INT8 weights move it by far less than 1%.
    assert math.isclose(zero3["losses"][0], math.log(84), rel_tol=0.05)
    assert math.isclose(every["losses"][0], zero3["losses"][0], rel_tol=0.01)
    # Plain FSDP2's gradient reduce-scatter in fp32: each rank owes every remote rank a quarter
    # of the (padded) gradient; padding adds at most a few rows.
    reduce_scatter = zero3["ledger_per_step"][0]["by_op"]["reduce_scatter"]["cross_node_bytes"]
    assert num_params * 4 / 4 * 2 <= reduce_scatter <= num_params * 4 / 4 * 2 * 1.02
    # hpZ's secondary copy under qwZ: 2 of the world's 4 payload rows, a byte per parameter and a
    # 4-byte scale per 256 (half the bf16 copy); each of the 17 parameters' slices of a row adds
    # at most a partial block's scale and 3 bytes rounding its codes up to 4.
    assert zero3["secondary_copy_bytes"] == [0] * 4
    codes = num_params / 2 * (1 + 4 / 256)
    assert all(codes <= b <= codes + 2 * 17 * (4 + 3) for b in every["secondary_copy_bytes"])
    # all three techniques: nothing but qwZ's forward gather and qgZ's second hop crosses nodes.
    techniques = every["ledger_per_step"][0]["by_technique"]
    assert techniques["hpZ"]["cross_node_bytes"] == 0
    total = sum(r["total"]["cross_node_bytes"] for r in every["ledger_per_step"])
    assert total < 0.25 * sum(r["total"]["cross_node_bytes"] for r in zero3["ledger_per_step"])
    # the unit comm timings: one layer, so the one unit is the root, every parameter in 4 chunks
    # (every dim 0 divides by the world size: no padding)
    units = record["unit_comms"]
    assert units["parameters"] == 17 and units["calls"] == 2 and units["gather_dtype"] == "bfloat16"
    assert units["chunk_numel"] == num_params // 4
    assert all(t > 0 for t in units["median_s"].values())
    assert units["all_gather_ratio"] == units["median_s"]["qwz_all_gather"] / units["median_s"]["plain_all_gather"]


AHEAD = replace(TINY, modes=("zero3", "all_overlap", "all_ahead"), warmup_steps=1, steps=2, param_dtype="float32")


def _run_ahead(rank: int, world_size: int) -> dict | None:
    return run(AHEAD)


def test_worker_steps_in_backward_like_the_plain_loop() -> None:
    """``all_ahead`` (AdamW per unit in backward, the next forward's gathers started there)
    trains the bench's model exactly as ``all_overlap`` does, and in a timed step's window it
    moves the same bytes (booked in backward instead of forward): the gathers it starts for the
    next step replace those the warm-up started for the first."""
    record, *_ = run_distributed(_run_ahead, 4, env={"ZEROPP_RANKS_PER_NODE": "2"})
    overlap, ahead = record["modes"]["all_overlap"], record["modes"]["all_ahead"]
    assert ahead["losses"] == overlap["losses"]
    for plain, early in zip(overlap["ledger_per_step"], ahead["ledger_per_step"], strict=True):
        assert early["total"] == plain["total"]
        forward = [sum(row["cross_node_bytes"] for row in ledger["rows"] if row["phase"] == "forward")
                   for ledger in (early, plain)]
        assert forward[0] == 0 < forward[1]


PEER = replace(TINY, modes=("zero3", "deepspeed", "hpz", "deepspeed_hpz"), steps=3, param_dtype="float32", lr=1e-2)
"""A large learning rate, so that a difference in the updates shows in the third step's loss
(with DeepSpeed's default clipping at norm 1.0 it moves by 3e-4 relative)."""


def _run_peer(rank: int, world_size: int, config: WorkerConfig) -> dict | None:
    return run(config)


@pytest.mark.slow
def test_deepspeed_zero3_trains_like_plain_fsdp2() -> None:
    """DeepSpeed ZeRO-3 (the benchmark's peer) and zeropp's plain FSDP2 mode on the same weights,
    batches and AdamW, in fp32, with DeepSpeed's default gradient clipping turned off: the same
    math in a different reduction order, so the losses of three steps agree to fp32 rounding
    (~1e-7 relative per op; 1e-5 leaves room for Adam's division where |grad| is near eps). The
    same holds with each system's hpZ over the node, and both hold the same secondary copy after
    a forward: the fp32 weights split over the node's 2 ranks (every parameter of the tiny GPT
    has a multiple of 4 elements, so neither system pads)."""
    pytest.importorskip("deepspeed", reason="the optional peer: DS_BUILD_OPS=0 pip install "
                        "--no-build-isolation -e '.[peer]' (make venv installs it)")
    # DeepSpeed builds its CPU shared-memory op on first use (~2.5 min, then cached): a long wait
    record, *_ = run_distributed(_run_peer, 4, PEER, env={"ZEROPP_RANKS_PER_NODE": "2"}, timeout=600)
    modes = record["modes"]
    for ours, peer in (("zero3", "deepspeed"), ("hpz", "deepspeed_hpz")):
        zeropp_losses, deepspeed = modes[ours]["losses"], modes[peer]
        assert len(deepspeed["losses"]) == 3 and deepspeed["ledger_per_step"] is None
        assert deepspeed["losses"][-1] < deepspeed["losses"][0]  # it trains
        for mine, theirs in zip(zeropp_losses, deepspeed["losses"]):
            assert math.isclose(theirs, mine, rel_tol=1e-5), (ours, zeropp_losses, deepspeed["losses"])
    half_of_the_weights = record["num_parameters"] * 4 // 2
    assert modes["hpz"]["secondary_copy_bytes"] == modes["deepspeed_hpz"]["secondary_copy_bytes"] == [
        half_of_the_weights] * 4
    assert modes["deepspeed"]["secondary_copy_bytes"] == [0] * 4


def test_deepspeed_hpz_mode_spans_the_node() -> None:
    from zeropp.tools.bench.worker import deepspeed_config
    from zeropp.tools.modes import MODES, System

    assert MODES["deepspeed_hpz"].system is System.DEEPSPEED and MODES["deepspeed_hpz"].hpz
    zero = deepspeed_config(PEER, 4, MODES["deepspeed_hpz"].deepspeed_options(2))["zero_optimization"]
    assert zero["stage"] == 3 and zero["zero_hpz_partition_size"] == 2
    assert zero["stage3_max_reuse_distance"] == zero["stage3_prefetch_bucket_size"] == 0
    assert deepspeed_config(PEER, 4, MODES["deepspeed"].deepspeed_options(2))["zero_optimization"] == {"stage": 3}
    with pytest.raises(ValueError, match="mode 'hpz' runs zeropp, not deepspeed"):
        MODES["hpz"].deepspeed_options(2)


def test_deepspeed_mode_needs_equal_micro_batches() -> None:
    from zeropp.tools.bench.worker import deepspeed_config

    with pytest.raises(ValueError, match="batch_size=10 must be a multiple of the world size 4"):
        deepspeed_config(replace(PEER, batch_size=10), 4)


@pytest.mark.parametrize("op,kind,per_peer,direct_cross,backend_cross", [
    # Measured on the 2 x 2 cluster with a chunk of c bytes per rank (frames / 1.046):
    (Op.ALL_GATHER, "world", 1, 8, 6),        # ring: 2 of the 4 ring edges cross, 3c each
    (Op.REDUCE_SCATTER, "world", 1, 8, 12),   # all-reduce of 4c underneath, ring: 6c per edge
    (Op.ALL_TO_ALL, "world", 1, 8, 8),        # direct sends
    (Op.ALL_TO_ALL, "inter", 1, 4, 4),
    (Op.ALL_GATHER, "intra", 1, 0, 0),
    # HSDP: an all-reduce of a 2c buffer over 2 ranks is counted as c owed to the peer twice; a
    # ring all-reduce of 2 ranks sends 2c per rank, the same: 8c in all.
    (Op.ALL_REDUCE, "inter", 1, 8, 8),
])
def test_ledger_backend_figure_matches_the_measured_gloo_ops(op, kind, per_peer, direct_cross,
                                                              backend_cross) -> None:
    ledgers = []
    for rank in range(4):
        ranks = {"world": [0, 1, 2, 3], "inter": [rank % 2, rank % 2 + 2],
                 "intra": [rank // 2 * 2, rank // 2 * 2 + 1]}[kind]
        ledger = CommLedger()
        ledger.record(op, GroupInfo.of(TOPOLOGY, ranks, rank, "gloo"), per_peer, torch.float32, "fsdp")
        ledgers.append(ledger.summary()["total"])
    assert sum(t["cross_node_bytes"] for t in ledgers) == direct_cross
    assert sum(t["backend_cross_node_bytes"] for t in ledgers) == backend_cross


def test_combined_ledger_sums_every_rank() -> None:
    """The demo's table: rank 0 alone sees no backend cross-node bytes for a ring all-gather (it
    sends only to its node neighbour), the ledger combined from every rank's export counts the
    ring's crossing edges, and its totals and rows are the sums of the ranks' own."""
    exports = []
    for rank in range(4):
        ledger = CommLedger()
        for _ in range(3):
            ledger.record(Op.ALL_GATHER, GroupInfo.of(TOPOLOGY, [0, 1, 2, 3], rank, "gloo"), 100, torch.int8, "qwZ")
            intra = [rank // 2 * 2, rank // 2 * 2 + 1]
            ledger.record(Op.ALL_GATHER, GroupInfo.of(TOPOLOGY, intra, rank, "gloo"), 40, torch.float32, "hpZ")
            ledger.step()
        exports.append(json.loads(json.dumps(ledger.export())))  # as gathered between processes
    assert exports[0]["rows"][0]["backend_cross_node_bytes"] == 0
    combined = CommLedger.combined(exports)
    assert combined.num_steps == 3 and combined.ranks == 4
    for count in ("calls", "bytes", "cross_node_bytes", "backend_bytes", "backend_cross_node_bytes"):
        assert combined.summary()["total"][count] == sum(sum(r[count] for r in e["rows"]) for e in exports)
        assert combined.summary(technique="hpZ")["total"][count] == sum(
            r[count] for e in exports for r in e["rows"] if r["technique"] == "hpZ")
    assert combined.summary()["total"]["backend_cross_node_bytes"] == 3 * 6 * 100  # the ring's 6c per call
    assert "summed over all 4 ranks" in combined.table() and "this rank" in CommLedger().table()
    with pytest.raises(ValueError, match="different numbers of steps \\[2, 3\\]"):
        CommLedger.combined([exports[0], {**exports[1], "num_steps": 2}])


def test_ledger_backend_figure_is_the_direct_sends_for_other_backends() -> None:
    ledger = CommLedger()
    ledger.record(Op.REDUCE_SCATTER, GroupInfo.of(TOPOLOGY, [0, 1, 2, 3], 1, "nccl"), 5, torch.float32, "fsdp")
    total = ledger.summary()["total"]
    assert (total["backend_bytes"], total["backend_cross_node_bytes"]) == (total["bytes"], total["cross_node_bytes"])


@pytest.fixture
def namespaces() -> None:
    reason = check_support()
    if reason is not None:
        pytest.skip(reason)
    if list_namespaces():
        pytest.skip(f"namespaces {list_namespaces()} exist: another cluster is up")


@pytest.mark.slow
def test_wire_matches_the_ledger_on_the_cluster(namespaces: None) -> None:
    config = replace(TINY, wire=True, embed_dim=256, num_heads=4)
    with comm.exclusive_cluster(2, None, wait_s=60):
        record, result = comm.launch_worker(config, 2, 2)
    assert result.exit_code == 0
    for mode, mode_record in record["modes"].items():
        classes = comm.link_classes(mode_record)
        # Frames carry 4.6% more than the payload; the two meetings around the step add a little.
        assert 1.0 <= classes["wire_vs_ledger"]["cross_node"] <= 1.10, (mode, classes)
        assert 1.0 <= classes["wire_vs_ledger"]["intra_node"] <= 1.10, (mode, classes)


def test_step_rows_of_a_peer_without_a_ledger() -> None:
    """DeepSpeed's collectives bypass the ledger: its row says n/a, not zero bytes."""
    from zeropp.tools.bench import step

    def result(seconds: float, ledger: list | None) -> dict:
        return {"median_step_s": seconds, "ledger_per_step": ledger, "step_times_s": [seconds],
                "losses": [4.0], "secondary_copy_bytes": [0], "wire_per_step": {
                    "cross_node_bytes": 100.0 * seconds, "intra_node_bytes": 50.0}}

    totals = {"backend_cross_node_bytes": 80, "cross_node_bytes": 60, "backend_bytes": 120}
    record = {"peak_rss_mb": [500.0], "modes": {"zero3": result(2.0, [{"total": totals}] * 2),
                                                "deepspeed": result(3.0, None)}}
    zero3, peer = step.mode_rows(record, "1gbit", None)
    assert (zero3["cross_node_bytes_ledger"], zero3["cross_node_bytes_direct"],
            zero3["intra_node_bytes_ledger"]) == (160, 120, 80)
    assert peer["cross_node_bytes_ledger"] is None and peer["intra_node_bytes_ledger"] is None
    assert peer["ratio_vs_zero3"] == 1.5 and peer["cross_node_bytes_wire"] == 300.0
    table = step.format_table([zero3, peer])
    assert "deepspeed" in table and "n/a" in table.splitlines()[-1]


def test_a_limited_rows_floor_is_its_link_time_or_its_unlimited_step() -> None:
    """The floor at 100 Mbit/s (12.5 MB/s per node link, 2 nodes): 54.9 MB on the wire is 2.196 s,
    longer than the 1.5 s step with no limit; 10 MB is 0.4 s, so the unlimited step sets it."""
    from zeropp.tools.bench.step import add_floors

    rows = [{"mode": "all", "bandwidth": "unlimited", "median_step_s": 1.5, "cross_node_bytes_wire": 54.9e6},
            {"mode": "all", "bandwidth": "100mbit", "median_step_s": 3.79, "cross_node_bytes_wire": 54.9e6},
            {"mode": "qgz", "bandwidth": "unlimited", "median_step_s": 1.5, "cross_node_bytes_wire": 10e6},
            {"mode": "qgz", "bandwidth": "100mbit", "median_step_s": 3.0, "cross_node_bytes_wire": 10e6},
            {"mode": "hpz", "bandwidth": "100mbit", "median_step_s": 3.0, "cross_node_bytes_wire": 10e6}]
    add_floors(rows, num_nodes=2)
    assert rows[0]["floor_s"] is None and rows[4]["floor_s"] is None  # no limit; no unlimited row of hpz
    assert rows[1]["floor_s"] == pytest.approx(2.196) and rows[1]["over_floor"] == pytest.approx(3.79 / 2.196)
    assert rows[3]["floor_s"] == 1.5 and rows[3]["over_floor"] == 2.0
