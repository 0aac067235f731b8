"""The GGUF's weights as the model directory's model.safetensors (its small files travelled as they are)."""

import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from oasiskv.models.gguf_convert import load_gguf

started = time.time()
checkpoint = load_gguf(Path(sys.argv[1]), dtype=torch.bfloat16, progress=False)
save_file(checkpoint.state, sys.argv[2], metadata={"format": "pt"})
print(f"converted {len(checkpoint.state)} tensors in {time.time() - started:.1f} s")
