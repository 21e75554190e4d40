"""zeropp inside other training stacks: HF ``Trainer`` (``hf``, with a DeepSpeed config read as
DeepSpeed's Trainer integration reads it: ``hf_deepspeed``), TRL's trainers (``hf_trl``) and
torchtitan (``torchtitan``). Each imports its stack only when imported itself; users name them as
``zeropp.hf`` and ``zeropp.torchtitan``."""
