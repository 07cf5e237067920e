"""The plain-PyTorch Llama a user would write instead of a framework, with the shape of a megahybrid preset:
RMSNorm, RoPE, causal SDPA (GQA through enable_gqa), SwiGLU, untied LM head; fp32 weights under bf16 autocast,
fused AdamW, gradient clipping, torch.compile. The comparison point of tools/bench_train.py."""
import torch
import torch.nn.functional as F
from torch import nn

from megahybrid.model.config import ModelConfig


def rope_tables(seq: int, head_dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
    return torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, d]; rotate-half RoPE."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim, self.eps = cfg.num_heads, cfg.kv_heads, hd, cfg.norm_eps
        self.attn_norm, self.mlp_norm = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(d, (cfg.num_heads + 2 * cfg.kv_heads) * hd, bias=False)
        self.out = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * cfg.ffn_size, bias=False)
        self.down = nn.Linear(cfg.ffn_size, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = F.rms_norm(x, (x.shape[-1],), self.attn_norm, self.eps)
        q, k, v = self.qkv(h).split([self.heads * self.head_dim, self.kv_heads * self.head_dim,
                                     self.kv_heads * self.head_dim], -1)
        q, k, v = (t.view(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        x = x + self.out(attn.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gate_up(F.rms_norm(x, (x.shape[-1],), self.mlp_norm, self.eps)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        for weight in (p for p in self.parameters() if p.dim() == 2):
            nn.init.normal_(weight, std=cfg.init_std)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy."""
        cos, sin = rope_tables(tokens.shape[1], self.cfg.head_dim, self.cfg.rope_base, tokens.device)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(F.rms_norm(x, (x.shape[-1],), self.norm, self.cfg.norm_eps))
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


class BaselineTrainer:
    """One optimizer step = `gas` micro-batches of forward + backward, clip to norm 1, fused AdamW."""

    def __init__(self, cfg: ModelConfig, micro_batch: int, gas: int, compile_model: bool, device: str):
        self.model = Llama(cfg).to(device)
        self.step_model = torch.compile(self.model) if compile_model else self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                           fused=True)
        self.cfg, self.micro_batch, self.gas, self.device = cfg, micro_batch, gas, device
        self.autocast = torch.autocast("cuda", torch.bfloat16, enabled=device == "cuda")

    def step(self, batches) -> None:
        for _ in range(self.gas):
            batch = next(batches)
            tokens = batch["tokens"].to(self.device, non_blocking=True)
            labels = batch["labels"].to(self.device, non_blocking=True)
            with self.autocast:
                loss = self.step_model(tokens, labels) / self.gas
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
