"""The block codes and the chunk codec: block quantization (torch, C on CPU, Triton on CUDA), the
asymmetric weight code, qgZ's lower-error gradient codes, and a chunk of per-parameter segments as
one packed uint8 payload."""
