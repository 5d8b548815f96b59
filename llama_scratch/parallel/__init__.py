"""How several processes share one run: torchrun's process group, DDP replicas and FSDP2 shards, and the strategy
object the rest of the package asks (strategy.py, the folder's interface: the package imports that module, not
distributed.py or sharding.py). The only folder that imports torch.distributed."""
