"""AdamW with float32 master weights, for low-precision (bfloat16) parameters.

torch's AdamW keeps its moments in the parameter's dtype and adds each update to the bfloat16 weight directly.
bfloat16 resolves about 1 part in 256, so an update of lr 5e-5 on a weight of 0.02 (a typical fine-tuning step)
is mostly rounded away. Here the optimizer steps a float32 copy of each parameter, with float32 moments, and
rounds the copy into the model after every step: 12 bytes of state per trained parameter instead of 4.
"""

from __future__ import annotations

import torch
from torch import nn


class MasterWeightAdamW(torch.optim.AdamW):
    """AdamW whose own parameters are float32 copies ("masters") of the model's trained parameters.

    `step` converts the model's gradients to float32 (freeing each low-precision gradient as its copy appears,
    unless it is a view into DDP's all-reduce bucket, whose memory stays anyway), steps the masters and copies them
    back into the model. `zero_grad` clears the model's gradients too, as told: freed, or zeroed in place.
    `state_dict` carries the masters, so a resumed run continues from the exact float32 values.
    """

    def __init__(self, groups: list[dict], **kwargs):
        self.model_params: list[nn.Parameter] = [p for g in groups for p in g["params"]]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.model_params]
        by_id = {id(p): m for p, m in zip(self.model_params, self.masters, strict=True)}
        super().__init__([{**g, "params": [by_id[id(p)] for p in g["params"]]} for g in groups], **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        for p, m in zip(self.model_params, self.masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
            if p.grad is not None and not p.grad._is_view():
                p.grad = None
        loss = super().step(closure)
        for p, m in zip(self.model_params, self.masters, strict=True):
            p.copy_(m)
            m.grad = None
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.model_params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.zero_()

    def state_dict(self) -> dict:
        return {**super().state_dict(), "master_weights": [m.detach() for m in self.masters]}

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        saved = state_dict.pop("master_weights", None)
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for i, (p, m) in enumerate(zip(self.model_params, self.masters, strict=True)):
                m.copy_(saved[i] if saved is not None else p)  # without saved masters: the model's values
                p.copy_(m)
