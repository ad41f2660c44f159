"""Predict, then measure, the GPT step, in plain PyTorch.

The plain-PyTorch equivalent of docs/tutorials/gpt.md, "Predict, then measure, its step": one
training step of benchmarks/plain/gpt.py's GPT (forward, backward, clipping, AdamW) traced on
fake tensors for its FLOPs, its peak of live tensor bytes and its time on an H100 by a per-op
roofline; then one real step on the CPU counted the same way.

    python benchmarks/plain/predict.py
"""

import sys
import weakref
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

sys.path.insert(0, str(Path(__file__).parent))
from gpt import CONFIG, GPT, get_batch, load_corpus, nats  # noqa: E402

H100_FP32_FLOPS = 67e12  # H100 SXM datasheet: FP32 (no tensor cores), FLOP/s
H100_BANDWIDTH = 3.35e12  # HBM3, bytes/s

# FlopCounterMode's formulas cover the CUDA attention kernels; the CPU ones take the same
# query, key and value (and grad_out first in the backward).
aten = torch.ops.aten
flop_registry[aten._scaled_dot_product_flash_attention_for_cpu] = (
    flop_registry[aten._scaled_dot_product_flash_attention])
flop_registry[aten._scaled_dot_product_flash_attention_for_cpu_backward] = (
    flop_registry[aten._scaled_dot_product_flash_attention_backward])


def tensors(tree) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def op_flops(func, args, kwargs, out) -> int:
    """FlopCounterMode's formula (matmuls, attention), else one FLOP per output element of a
    pointwise op or per input element of a reduction; other ops (norms, losses) count 0."""
    if func._overloadpacket in flop_registry:
        return flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
    if torch.Tag.pointwise in func.tags:
        return sum(t.numel() for t in tensors(out))
    if torch.Tag.reduction in func.tags:
        return args[0].numel()
    return 0


class StepCounter(TorchDispatchMode):
    """Every aten op's FLOPs and roofline time on an H100, and the peak of live storage bytes."""

    def __init__(self):
        super().__init__()
        self.flops, self.seconds, self.live, self.peak = 0, 0.0, 0, 0
        self.storages = set()

    def track(self, *tensors: torch.Tensor) -> bool:
        """Count the storages of ``tensors`` as live until freed; True if any was new."""
        new = False
        for t in tensors:
            storage = t.untyped_storage()
            if id(storage) not in self.storages and storage.nbytes():
                self.storages.add(id(storage))
                weakref.finalize(storage, self._free, id(storage), storage.nbytes())
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                new = True
        return new

    def _free(self, key: int, nbytes: int) -> None:
        self.storages.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs, outputs = tensors((args, kwargs)), tensors(out)
        # Views and metadata queries make no storage and write nothing: no work.
        if self.track(*outputs) or func._schema.is_mutable:
            flops = op_flops(func, args, kwargs, out)
            moved = sum(t.numel() * t.element_size() for t in inputs + outputs)
            self.flops += flops
            self.seconds += max(flops / H100_FP32_FLOPS, moved / H100_BANDWIDTH)
        return out


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    return torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": CONFIG["weight_decay"]},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=CONFIG["lr"], betas=(0.9, 0.95))


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> None:
    """One step of benchmarks/plain/gpt.py's training loop (its schedule aside)."""
    loss = nats(model, x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    # foreach=False: fake tensors take the per-tensor path (foreach is for torch.Tensor only)
    nn.utils.clip_grad_norm_(model.parameters(), CONFIG["max_grad_norm"], foreach=False)
    optimizer.step()


def count_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> StepCounter:
    """Count the second step: the first makes AdamW's state, as in a training run."""
    optimizer = make_optimizer(model)
    train_step(model, optimizer, x, y)
    with StepCounter() as counter:
        state = [t for per_param in optimizer.state.values() for t in per_param.values()]
        counter.track(*model.parameters(), *(p.grad for p in model.parameters()), *state, x, y)
        train_step(model, optimizer, x, y)
    return counter


generator = torch.Generator().manual_seed(0)
with FakeTensorMode():  # no data, no parameter memory: shapes and dtypes only
    corpus = torch.empty(2**20, dtype=torch.uint8)
    predicted = count_step(GPT(CONFIG), *get_batch(corpus, CONFIG, generator))
train, _ = load_corpus(CONFIG["source_dir"])
measured = count_step(GPT(CONFIG), *get_batch(train, CONFIG, generator))
print(f"FLOPs  predicted {predicted.flops:,}, counted {measured.flops:,}")
print(f"peak   predicted {predicted.peak:,} B, measured {measured.peak:,} B")
print(f"h100   {1e3 * predicted.seconds:.3f} ms a step, MFU at most "
      f"{predicted.flops / (predicted.seconds * H100_FP32_FLOPS):.0%}")
assert (predicted.flops, predicted.peak) == (measured.flops, measured.peak)
