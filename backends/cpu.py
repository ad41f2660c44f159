"""The CPU backends: fp32, bf16 and fp16 autocast, and simulated fp8 / MX / NVFP4 matmuls.

``cpu-bf16`` and ``cpu-fp16`` run the same autocast code path as CUDA mixed precision, and the
simulated formats the same numbers as fp8 and block-format tensor cores, on any machine.

>>> import torch
>>> with cpu_bf16.autocast():
...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
torch.bfloat16
"""

from minitrain.precision import Backend

cpu = Backend("cpu", "cpu", "fp32")
cpu_bf16 = Backend("cpu-bf16", "cpu", "bf16")
cpu_fp16 = Backend("cpu-fp16", "cpu", "fp16")  # with dynamic loss scaling
cpu_fp8 = Backend("cpu-fp8", "cpu", "fp8")  # e4m3 forward, e5m2 backward, delayed scaling
cpu_mxfp8 = Backend("cpu-mxfp8", "cpu", "mxfp8")  # 32-element blocks, e8m0 scales
cpu_mxfp4 = Backend("cpu-mxfp4", "cpu", "mxfp4")
cpu_nvfp4 = Backend("cpu-nvfp4", "cpu", "nvfp4")  # 16-element blocks, e4m3 and fp32 scales
