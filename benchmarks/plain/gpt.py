"""nanoGPT's GPT in plain PyTorch, trained on Python's standard library byte by byte.

The plain-PyTorch equivalent of examples/gpt.py: the same pre-LayerNorm GPT-2 (tied head,
nanoGPT's init), corpus and held-out split, AdamW with its warmup-cosine schedule, decay mask and
clipping, and the same held-out evaluation; loss in nats and in bits per byte (8 bits: uniform).
Not mirrored, as `minitrain run` gives them: checkpoints, resume, metrics files, resource report.

    python benchmarks/plain/gpt.py --steps 600
"""

import hashlib
import math
import sys
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CONFIG = {
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 128,
    "block_size": 128,
    "dropout": 0.0,
    "bias": False,
    "batch_size": 16,
    "lr": 3e-3,
    "warmup_steps": 30,
    "weight_decay": 0.1,
    "max_grad_norm": 1.0,
    "steps": 600,
    "eval_batches": 8,
    "eval_every": 100,
    "source_dir": "",  # .py files to train on; "" = the standard library
}

VOCAB = 256
LN2 = math.log(2.0)
VAL_FRACTION = 0.05


def load_corpus(source_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and held-out bytes of the .py files (installed packages skipped), in sorted order,
    each ending in a newline; about 5% of the files are held out by a hash of their path."""
    root = Path(source_dir or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    names = sorted(path.relative_to(root).as_posix() for path in root.rglob("*.py")
                   if path.is_file() and not skip.intersection(path.relative_to(root).parts))
    train, val = bytearray(), bytearray()
    for name in names:
        content = (root / name).read_bytes()
        if content and not content.endswith(b"\n"):
            content += b"\n"
        digest = hashlib.sha256(name.encode()).digest()[:8]
        (val if int.from_bytes(digest, "big") / 2**64 < VAL_FRACTION else train).extend(content)
    return torch.frombuffer(train, dtype=torch.uint8), torch.frombuffer(val, dtype=torch.uint8)


def get_batch(data: torch.Tensor, config: dict, generator: torch.Generator) -> tuple:
    """Random windows of ``block_size`` bytes and their next bytes."""
    seq = config["block_size"]
    starts = torch.randint(len(data) - seq, (config["batch_size"],), generator=generator)
    windows = data.unfold(0, seq + 1, 1)[starts].long()
    return windows[:, :-1], windows[:, 1:]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        d, bias = config["n_embd"], config["bias"]
        self.n_head, self.dropout = config["n_head"], config["dropout"]
        self.c_attn = nn.Linear(d, 3 * d, bias=bias)
        self.c_proj = nn.Linear(d, d, bias=bias)
        self.resid_dropout = nn.Dropout(config["dropout"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(x.shape[-1], dim=-1)
        q, k, v = (t.unflatten(-1, (self.n_head, -1)).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).flatten(2)))


class MLP(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        d, bias = config["n_embd"], config["bias"]
        self.c_fc = nn.Linear(d, 4 * d, bias=bias)
        self.c_proj = nn.Linear(4 * d, d, bias=bias)
        self.dropout = nn.Dropout(config["dropout"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config["n_embd"], bias=config["bias"])
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config["n_embd"], bias=config["bias"])
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, config["n_embd"])
        self.wpe = nn.Embedding(config["block_size"], config["n_embd"])
        self.drop = nn.Dropout(config["dropout"])
        self.h = nn.ModuleList(Block(config) for _ in range(config["n_layer"]))
        self.ln_f = nn.LayerNorm(config["n_embd"], bias=config["bias"])
        proj_std = 0.02 / math.sqrt(2 * config["n_layer"])
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.ndim == 2:
                nn.init.normal_(p, std=proj_std if name.endswith("c_proj.weight") else 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.wte(ids) + self.wpe(positions))
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)


def nats(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def flops_per_step(config: dict) -> int:
    """Matmul FLOPs of a training step, 3 x forward: per token and layer 2·12·d² in the
    projections and MLP plus 2·2·T·d in ``QKᵀ`` and ``AV`` (PaLM, Appendix B), and the head."""
    d, layers, seq = config["n_embd"], config["n_layer"], config["block_size"]
    forward_per_token = layers * (24 * d * d + 4 * seq * d) + 2 * d * VOCAB
    return 3 * config["batch_size"] * seq * forward_per_token


def cosine_with_warmup(config: dict):
    """The lr factor after ``step`` updates: linear warmup from 0, then cosine decay to 0."""
    decay_steps = max(config["steps"], 1)
    warmup = min(config["warmup_steps"], decay_steps - 1)

    def factor(step: int) -> float:
        if step < warmup:
            return step / warmup
        progress = min((step - warmup) / (decay_steps - warmup), 1.0)
        return 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@torch.no_grad()
def evaluate(model: nn.Module, eval_set: list) -> dict[str, float]:
    model.eval()
    val_loss = sum(nats(model, x, y).item() for x, y in eval_set) / len(eval_set)
    model.train()
    return {"val_loss": val_loss, "val_bpb": val_loss / LN2}


def main(config: dict) -> None:
    torch.manual_seed(0)  # init and dropout
    data_generator = torch.Generator().manual_seed(0)
    train, val = load_corpus(config["source_dir"])
    eval_generator = torch.Generator().manual_seed(1234)
    eval_set = [get_batch(val, config, eval_generator) for _ in range(config["eval_batches"])]

    model = GPT(config)
    # nanoGPT decays the 2-D weights (matmuls and embeddings), not biases or norms.
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": config["weight_decay"]},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=config["lr"], betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(config))
    print(f"{sum(p.numel() for p in params):,} params, {flops_per_step(config):,} FLOPs per step")

    steps, every = config["steps"], config["eval_every"]
    for step in range(1, steps + 1):
        x, y = get_batch(train, config, data_generator)
        loss = nats(model, x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(params, config["max_grad_norm"] or math.inf)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        print(f"step {step}: loss {loss.item():.4f} bpb {loss.item() / LN2:.4f} lr {lr:.2e} "
              f"grad_norm {grad_norm:.3f}")
        if every and step % every == 0:
            print(f"step {step}: {evaluate(model, eval_set)}")
    if not every or steps < every:
        print(f"final: {evaluate(model, eval_set)}")


if __name__ == "__main__":
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else None
    main({**CONFIG, "steps": CONFIG["steps"] if steps is None else steps})
