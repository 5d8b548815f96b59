"""How several processes share one run: torchrun's process group, DDP replicas and FSDP2 shards, and
the strategy object the rest of the code asks. The only folder that imports torch.distributed."""
