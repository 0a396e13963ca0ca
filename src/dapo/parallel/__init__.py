"""Data parallelism on torch.distributed: process groups and collectives (``distributed``),
FSDP2 sharding, gathering and full state dicts (``sharding``).

The layer below :mod:`dapo.models`: it imports no other dapo package. Choosing FSDP2 or DDP
for the policy (which reads its precision) is :mod:`dapo.models.data_parallel`.
"""
