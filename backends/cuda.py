"""The CUDA backends on device 0: bf16 autocast over fp32 master params (the chapter's 3.5.9
recipe), fp16 autocast with loss scaling, and fp8 matmuls on fp8 tensor cores.

``cuda-fp8`` runs the ``fp8`` policy, as ``cpu-fp8`` does, with each GEMM through
``torch._scaled_mm`` (compute capability >= 8.9) on the same fp8 codes the simulation rounds
to; the rest of the math stays fp32.
"""

from minitrain.precision import Backend, policy

cuda = Backend("cuda", "cuda:0", "bf16")
cuda_fp16 = Backend("cuda-fp16", "cuda:0", "fp16")  # with dynamic loss scaling
cuda_fp8 = Backend("cuda-fp8", "cuda:0", policy("fp8")._replace(matmul_format="fp8-scaled-mm"))
