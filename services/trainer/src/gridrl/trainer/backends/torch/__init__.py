"""The torch trainer backend (``--backend torch``).

``backend.py`` (``TorchTrainerBackend``: the interface, optimizer and schedule, checkpoint
files) over ``policy.py`` (a peft LoRA on a transformers model, its forwards, adapter files,
the device), ``update.py`` (one optimizer step over padded micro-batches, behaviour-aligned
logprobs), ``losses.py`` (the per-token surrogate, KLs, importance weights) and
``distributed.py`` (DDP under ``torchrun``).
"""
