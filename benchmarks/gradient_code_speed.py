"""qgZ's gradient codes through the chunk codec on CPU, the torch path against the C kernels.

    python benchmarks/gradient_code_speed.py [--out benchmarks/results/gradient_code_speed.json]

One thread, fp32 chunks of the 25M benchmark GPT's shapes split over 4 ranks (8 matrices of
512 x 512 and 8 vectors of 2,048, as one chunk codec lays them out), 3 rows (a hop's chunks).
Per code (the default plain INT4 and INT8 hops; ``all_scale8``'s INT8 intra-node hop, evenly
spaced levels with 8-bit scales, and its INT4 cross-node hop, normal levels with 8-bit scales
and the scale search), the median of 5 encodes and 5 decodes after one warm-up, per million
elements, and the ratio of each code's time to the plain INT4 code's on the C kernels, measured
in the same run. Prints a table and writes JSON. A timing benchmark: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from zeropp.codes import native, quant
from zeropp.codes.codec import ChunkCodec, segments_for
from zeropp.codes.gradcode import GradientCode

NUMELS = [512 * 512] * 8 + [2048] * 8
RANKS = 4
ROWS = 3
REPEATS = 5
CODES = {  # name: (code, bits, block size)
    "plain INT4 (the default, both hops)": (GradientCode(), 4, 256),
    "plain INT8": (GradientCode(), 8, 256),
    "all_scale8 intra-node: INT8, 8-bit scales": (GradientCode(levels="normal", scale_bits=8), 8, 64),
    "all_scale8 cross-node: INT4 normal levels, 8-bit scales, search": (
        GradientCode(levels="normal", scale_bits=8), 4, 64),
}


def _median_ms(call, *args) -> float:
    call(*args)
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        call(*args)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/gradient_code_speed.json")
    args = parser.parse_args()
    if not native.available():
        raise SystemExit(f"the C kernels are not available here: {native.unavailable_reason()}")
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    records = []
    for name, (code, bits, block_size) in CODES.items():
        segments = segments_for(NUMELS, [True] * len(NUMELS), RANKS, bits, grouped_scales=code.grouped_scales)
        codec = ChunkCodec(segments, block_size, torch.float32, code)
        chunks = torch.randn(ROWS, codec.numel, generator=generator)
        packed = torch.empty(ROWS, codec.nbytes, dtype=torch.uint8)
        decoded = torch.empty_like(chunks)
        millions = chunks.numel() / 1e6
        for kernel in ("torch", "native"):
            previous = quant.set_kernel(kernel)
            try:
                encode = _median_ms(codec.encode, chunks, packed) / millions
                decode = _median_ms(codec.decode, packed, decoded) / millions
            finally:
                quant.set_kernel(previous)
            records.append({"code": name, "kernel": kernel, "bits": bits, "block_size": block_size,
                            "encode_ms_per_million": encode, "decode_ms_per_million": decode})
    base = next(r for r in records if r["kernel"] == "native" and r["code"].startswith("plain INT4"))
    print(f"{'code':66s} {'kernel':6s} {'encode ms/M':>11s} {'x plain4':>8s} {'decode ms/M':>11s} {'x plain4':>8s}")
    for record in records:
        record["encode_x_plain4_native"] = record["encode_ms_per_million"] / base["encode_ms_per_million"]
        record["decode_x_plain4_native"] = record["decode_ms_per_million"] / base["decode_ms_per_million"]
        print(f"{record['code']:66s} {record['kernel']:6s} {record['encode_ms_per_million']:11.2f} "
              f"{record['encode_x_plain4_native']:8.1f} {record['decode_ms_per_million']:11.2f} "
              f"{record['decode_x_plain4_native']:8.1f}")
    machine = {"torch": torch.__version__, "threads": 1, "load_average_1min": _load()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine, "numels": NUMELS, "ranks": RANKS, "rows": ROWS,
                                          "records": records}, indent=1))
    print(f"wrote {args.out}")


def _load() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return None


if __name__ == "__main__":
    main()
