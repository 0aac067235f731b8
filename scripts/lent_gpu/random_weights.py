"""Random bf16 weights under the 0.5B's tensor names and shapes: a model for the smoke run of the
GPU path only (its tokens mean nothing), made on the machine instead of carried."""

import json
import sys

import torch
from safetensors.torch import save_file

shapes = json.load(open(sys.argv[1]))
generator = torch.Generator(device="cuda").manual_seed(0)
state = {}
for name, shape in shapes.items():
    if name.endswith("norm.weight"):
        state[name] = torch.ones(shape, dtype=torch.bfloat16)
    elif name.endswith(".bias"):
        state[name] = torch.zeros(shape, dtype=torch.bfloat16)
    else:
        state[name] = (torch.randn(shape, generator=generator, device="cuda") * 0.02).to(torch.bfloat16).cpu()
save_file(state, sys.argv[2], metadata={"format": "pt"})
print(f"wrote {len(state)} random tensors")
