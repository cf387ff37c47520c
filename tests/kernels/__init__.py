"""What the kernel tests share: they run on a GPU, or on CPU under the Triton interpreter
(TRITON_INTERPRET=1 with triton installed), which is how the kernels are developed without one."""
import importlib.util
import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_KERNELS = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRET),
                                 reason="needs a CUDA device (or TRITON_INTERPRET=1 with triton)")]
