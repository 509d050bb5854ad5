"""Frameworks: models exported as their own framework ships them and parallelizes them.

`megatron` (Megatron-Core's GPTModel), with `megatron_shims` (its CUDA-only helpers replaced on
the CPU, listed) and `megatron_bugs` (historical TP mistakes reintroduced into its modules).

May import: exporters.capture, exporters.zoo.configs, exporters.errors, refine's base modules.
"""
