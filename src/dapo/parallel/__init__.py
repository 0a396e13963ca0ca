"""Data parallelism: process groups and collectives (``distributed``), FSDP2 (``sharding``)."""
