"""The peer's side of gpu_check: transformers' `LlamaForSequenceClassification` (+ PEFT for LoRA) trained on the
same checkpoint, the same micro-batches and the same trained parameters as our run of a recipe, in a process of its
own, timed the same way.

    python benchmarks/peer_step.py JOB_DIR      # JOB_DIR/job.json and head.safetensors, written by gpu_check.py

What is the same on both sides, so that tokens per second compare the training steps alone (on an end-to-end
row, ours' clock adds the frozen-prefix cache's pass, the price of the frozen blocks the peer runs every step):
- the checkpoint (gpu_check's random one, Hugging Face layout) and the classification head's starting weights
  (ours, copied into `score`): the first step's loss must come out equal;
- every micro-batch's rows (ours packed, the peer's right-padded to the batch's longest: texts grouped by length
  pad little) and each micro-batch's loss counting its rows, computed outside the model's forward on both;
- what trains: the same blocks (or LoRA adapters of the same rank, alpha and targets in the same blocks, kept in
  the model's dtype: `autocast_adapter_dtype=False`), the final norm where ours trains it, the head;
- the steps timed: those after the warm-up, or for an end-to-end row (`whole` in the job) every step from the first;
- AdamW's fused kernel, gradient clipping at the same norm, one read of the loss per step (the host's one wait);
- scaled_dot_product_attention with cuDNN's kernel off (it plans every new shape, ~100 ms each: gpu_check asks our
  side for flash first for the same reason), no gradient checkpointing, no compile.
What differs, and is reported: the peer's optimizer keeps its moments in the parameters' dtype (bfloat16), ours
keeps float32 master weights and moments by default (`optimizer_state` in the job); the peer runs the frozen blocks
below the trained ones in every step, where ours may run them once for the whole data set (the frozen-prefix cache):
that is the point of comparing.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# The job's trained projections, by our names (llama_scratch.model.lora.TARGETS) -> transformers' module names.
HF_TARGETS = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}


def build(job: dict, directory: Path, device: torch.device):
    """The peer model with exactly the job's trained parameters, and those parameters."""
    import transformers
    from safetensors.torch import load_file

    dtype = getattr(torch, job["dtype"])
    # Straight onto the GPU (device_map): not 16 GB through host memory first.
    where = {"device_map": str(device)} if device.type == "cuda" else {}
    model = transformers.LlamaForSequenceClassification.from_pretrained(
        job["checkpoint"], num_labels=job["num_classes"], dtype=dtype, attn_implementation="sdpa", **where
    ).to(device)
    model.config.pad_token_id = job["pad_id"]
    with torch.no_grad():
        model.score.weight.copy_(load_file(directory / "head.safetensors")["head.weight"].to(device, dtype))
    model.requires_grad_(False)
    if job["lora"] is not None:
        import peft

        lora = job["lora"]
        config = peft.LoraConfig(
            r=lora["rank"],
            lora_alpha=lora["alpha"],
            lora_dropout=lora["dropout"],
            target_modules=[HF_TARGETS[t] for t in lora["targets"]],
            layers_to_transform=lora["blocks"],
            bias="none",
        )
        model = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
        inner = model.base_model.model
    else:
        inner = model
        for b in job["trained_blocks"]:
            inner.model.layers[b].requires_grad_(True)
    inner.score.requires_grad_(True)
    if job["final_norm"]:
        inner.model.norm.requires_grad_(True)
    if job["embeddings"]:
        inner.model.embed_tokens.requires_grad_(True)
    model.train()
    return model, [p for p in model.parameters() if p.requires_grad]


def micro_batch(rows: list[list[int]], labels: list, pad_id: int, device: torch.device):
    """Right-padded ids, the 1/0 mask and the labels, in one non-blocking copy each (pinned on a GPU)."""
    longest = max(map(len, rows))
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    pin = device.type == "cuda"
    move = lambda t: (t.pin_memory() if pin else t).to(device, non_blocking=pin)  # noqa: E731
    return move(ids), move(mask), move(torch.tensor(labels))


def step(model, params, optimizer, batches: list[dict], job: dict, device: torch.device) -> float:
    """One optimizer step over its micro-batches; each micro-batch's mean loss weighted by its share of the step's
    rows (as ours); the loss read once."""
    total_rows = sum(len(b["labels"]) for b in batches)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for b in batches:
        ids, mask, labels = micro_batch(b["ids"], b["labels"], job["pad_id"], device)
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits.float(), labels)
        (loss * (len(b["labels"]) / total_rows)).backward()
        loss_sum += loss.detach().double() * len(b["labels"])
    torch.nn.utils.clip_grad_norm_(params, job["clip_grad"])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum.item() / total_rows


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def launches(run, device: torch.device) -> int | None:
    """Device events (kernels, copies) one call of `run` makes, by the profiler; None without a GPU."""
    if device.type != "cuda":
        run()
        return None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        sync(device)
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


def main(directory: Path) -> dict:
    job = json.loads((directory / "job.json").read_text())
    device = torch.device(job["device"])
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    started = time.perf_counter()
    model, params = build(job, directory, device)
    load_seconds = time.perf_counter() - started
    optimizer = torch.optim.AdamW(
        params, lr=job["lr"], weight_decay=job["weight_decay"], fused=device.type == "cuda" or None
    )
    steps = job["steps"]
    # An end-to-end row times every step from the first, as ours is timed; a row of steps leaves the warm-up out.
    warmup = 0 if job["whole"] else job["warmup"]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    launched = None
    if warmup:
        loss_first = step(model, params, optimizer, steps[0], job, device)
        for s in steps[1 : warmup - 1]:
            step(model, params, optimizer, s, job, device)
        launched = launches(lambda: step(model, params, optimizer, steps[warmup - 1], job, device), device)
    sync(device)
    start = time.perf_counter()
    losses = [step(model, params, optimizer, s, job, device) for s in steps[warmup:]]
    sync(device)
    seconds = time.perf_counter() - start
    if not warmup:  # one step more, after the clock, for its launches (as ours)
        launched = launches(lambda: step(model, params, optimizer, steps[0], job, device), device)
    if not warmup:
        loss_first = losses[0]
    loss_last = losses[-1]
    tokens = sum(len(r) for s in steps[warmup:] for b in s for r in b["ids"])
    import peft
    import transformers

    return {
        "peer_tokens_per_s": tokens / seconds,
        "peer_seconds": seconds,
        "peer_steps": len(losses),
        "peer_tokens": tokens,
        "peer_loss_first": loss_first,
        "peer_loss_last": loss_last,
        "peer_trainable_params": sum(p.numel() for p in params),
        "peer_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "peer_launches_per_step": launched,
        "peer_load_seconds": load_seconds,
        "peer_optimizer_state": "param (fused AdamW, moments in the parameters' dtype)",
        "peer_versions": {"transformers": transformers.__version__, "peft": peft.__version__},
        "peer_note": job["note"],
    }


if __name__ == "__main__":
    out = main(Path(sys.argv[1]))
    (Path(sys.argv[1]) / "peer.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out))
