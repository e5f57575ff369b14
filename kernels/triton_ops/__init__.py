"""Triton kernels behind the fused ops. Imported only when a Triton backend runs, so Triton stays optional.

Each launcher takes and returns torch tensors; autograd and dispatch live in the op modules one
level up. Kernels compute in float32 whatever the storage dtype, and handle any row length with
masks (the tests use ragged sizes on purpose).
"""
