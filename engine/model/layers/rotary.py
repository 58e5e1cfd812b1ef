"""Rotary position embeddings: cos and sin tables from the model's own rotary module (its frequencies are fixed:
engine/model/support.py), one table per rotary key (a model whose layer types rotate differently has several), and
their application to q and k (the native kernel in place where it is built, ATen's otherwise; chosen once)."""
import torch


class Rotary:
    def __init__(self, module, keys: list, head_dim: int, like: torch.Tensor):
        """module: the Hugging Face model's rotary embedding; keys: each layer's argument to it (None: one table);
        like: a tensor of the activations' dtype and device."""
        self.module, self.head_dim, self.like = module, head_dim, like
        self.keys = list(dict.fromkeys(keys))  # the tables a step computes
        self.index = [self.keys.index(k) for k in keys]  # each layer's table
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of positions [0, 2^k)
        self.apply = self._aten  # apply(qk, cos, sin); use_ops picks the native kernel

    def use_ops(self, ops) -> None:
        """apply through the native kernels `ops` (in place), or ATen's operators (None)."""
        self.apply = self._native(ops) if ops is not None else self._aten

    def tables(self, positions: torch.Tensor, end: int, traced: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, D x tables] of each position (all below `end`), sin's first half negated (rotate_half(x) *
        sin = swap(x) * this): rows of tables computed once for positions [0, 2^k), grown when a step reaches past
        them; a traced step computes its own (no table that grows under torch.compile)."""
        if traced:
            return self._rows(positions)
        if self._table is None or self._table[0].shape[0] < end:
            self._table = self._rows(torch.arange(1 << (end - 1).bit_length(), device=self.like.device))
        cos, sin = self._table
        return cos[positions], sin[positions]

    def per_layer(self, cos: torch.Tensor, sin: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (cos, sin) [T, D]."""
        if len(self.keys) == 1:
            return [(cos, sin)] * len(self.index)
        D = self.head_dim
        own = [(c.contiguous(), s.contiguous()) for c, s in zip(cos.split(D, -1), sin.split(D, -1))]
        return [own[i] for i in self.index]

    def _rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        D = self.head_dim
        tables = [self.module(self.like, positions[None], *([] if key is None else [key])) for key in self.keys]
        return (torch.cat([cos[0] for cos, _ in tables], dim=-1),
                torch.cat([t for _, sin in tables for t in (-sin[0, :, :D // 2], sin[0, :, D // 2:])], dim=-1))

    @staticmethod
    def _native(ops):
        def apply(qk, cos, sin):
            ops.rotary_(qk, cos, sin)
            return qk
        return apply

    @staticmethod
    def _aten(qk, cos, sin):
        """qk [T, heads, D]: x * cos + x with its halves swapped * sin (cos, sin [T, D]; sin's first half negated)."""
        T, heads, D = qk.shape
        return qk.view(T, heads, 2, D // 2).flip(2).view(qk.shape).mul_(sin[:, None]).addcmul_(qk, cos[:, None])
