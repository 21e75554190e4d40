"""What ZeRO++ adds to FSDP2, each an FSDP2 comm or hook: qwZ's quantized weight gather, hpZ's
secondary copy inside the node (and on 2-D meshes), qgZ's two-hop quantized gradient
reduction, quantized HSDP's replica reduction, and the live audit of their error."""
