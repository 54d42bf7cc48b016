"""Muon on FSDP2-sharded matrices: the Newton-Schulz iterations need each whole matrix, and a rank
holds some of its rows.

Each rank runs the elementwise parts of the step on its rows (functional.muon_momentum, with the
momentum buffer in its format, or the fused CPU kernel's, where it steps as in one process; and
functional.muon_apply). In between, each matrix's update is
gathered to one rank, its owner, in bf16: the iterations start by rounding it to bf16, so the
gathered matrix is exactly the one a single process orthogonalizes, at half the bytes of fp32. The
owner orthogonalizes it and scatters the rows back. Matrices are dealt out by their place in the
param group (owner = place mod ranks), so each is orthogonalized once and the ranks share the work;
all gathers are in flight before any iteration starts, and all scatters after the last. The numbers
are those of one process: the same functions on the same values.
"""

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import Shard

from . import fused_cpu, precision
from .base import fold_stale_buffers, param_update_of
from .distributed import local
from .muon_parts import MuonParts


def check_sharding(param) -> None:
    """Raise a ValueError unless ``param`` is sharded as FSDP2 shards it: rows over a 1-D mesh."""
    if param.device_mesh.ndim == 1 and tuple(param.placements) == (Shard(0),):
        return
    given = f"a parameter of shape {tuple(param.shape)} has placements {tuple(param.placements)} over a {param.device_mesh.ndim}-D mesh"
    if param.device_mesh.ndim != 1:  # HSDP, FSDP2 with tensor parallelism: every matrix is so
        fix = "Muon does not step a matrix sharded over a 2-D mesh (HSDP, FSDP2 with tensor parallelism): shard over a 1-D mesh, or use AdamW"
    else:
        fix = (
            "step it with AdamW (build Muon and AdamW from muon_split(model)'s two lists, moving it to the second), or shard "
            "it by rows alone"
        )
    raise ValueError(f"Muon steps DTensor parameters sharded by rows over a 1-D mesh (FSDP2's fully_shard); {given}: {fix}")


def step(optimizer, group: dict, items: list[tuple[Tensor, Tensor, Tensor]]) -> None:
    """One Muon step of each (DTensor parameter, its tensor to update, gradient) of ``group``."""
    (lr, decay, momentum, one_minus_momentum, eps), flags = optimizer._tensor_arguments(group, local(items[0][1]).device)
    parts = MuonParts(optimizer._compile)
    place = {id(p): i for i, p in enumerate(group["params"])}
    rows_of, updates, in_kernel = [], [], []  # each matrix's rows and their update in bf16; what the fused CPU kernel computes
    for p, tensor, grad in items:
        state = optimizer.state[p]
        optimizer._init_state(p, group, state)  # the missing ones: a first step's, a buffer of a parameter cast to bf16 since
        rows, grad, buffer = local(tensor.detach()), local(grad), local(state["momentum_buffer"])
        if param_update_of(p, group) != group["param_update"]:  # not bf16 (now): a buffer its bf16 steps kept is stale
            fold_stale_buffers(rows, state)
        rows_of.append(rows)
        if not rows.numel():  # an empty shard (more ranks than rows) only counts the step
            state["step"].add_(1)
            updates.append(rows.new_zeros(rows.shape, dtype=torch.bfloat16))
        elif optimizer._use_fused(p, group["fused"], rows, grad, state["step"], [buffer], param_update_of(p, group)):
            updates.append(torch.empty(rows.shape, dtype=torch.bfloat16))  # the kernel writes it in bf16: the same numbers
            in_kernel.append((updates[-1], grad.contiguous(), state["step"], buffer))
        else:
            update = parts.momentum(grad, state["step"], buffer, momentum, one_minus_momentum, nesterov=flags["nesterov"])
            updates.append(update.bfloat16())
    if in_kernel:
        fused_cpu.muon_momentum(in_kernel, group)
    jobs = [_Job(p, rows, update, place[id(p)]) for (p, _, _), rows, update in zip(items, rows_of, updates)]
    for job in jobs:
        job.gather()
    for job in jobs:
        job.orthogonalize(lambda full: parts.newton_schulz(full, flags["ns_coefficients"], flags["ns_steps"], eps))
    for job in jobs:
        job.scatter()
    for job, (p, tensor, grad) in zip(jobs, items):
        if job.rows.numel():
            mode = param_update_of(p, group)
            extra = precision.extra_state_name(mode)
            parts.apply(job.rows, local(optimizer.state[p][extra]) if extra else None, job.result(), lr, decay,
                        shape=tuple(p.shape), adjust_lr_fn=flags["adjust_lr_fn"], param_update=mode)  # fmt: skip


class _Job:
    """One matrix: its rows' update gathered to its owner, orthogonalized there, scattered back."""

    def __init__(self, param, rows: Tensor, update: Tensor, place: int):
        self.rows, self.shape = rows, tuple(param.shape)
        self.group = param.device_mesh.get_group()
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.owner = place % self.world
        self.chunk = -(-self.shape[0] // self.world)  # FSDP2's rows per rank (torch.chunk's), the last ones fewer
        self.mine = torch.zeros((self.chunk, *self.shape[1:]), dtype=torch.bfloat16, device=rows.device)
        self.mine[: update.shape[0]] = update
        self.pieces = [torch.empty_like(self.mine) for _ in range(self.world)] if self.rank == self.owner else None
        self.work = None

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank)

    def gather(self) -> None:
        self.work = dist.gather(self.mine, self.pieces, dst=self._global(self.owner), group=self.group, async_op=True)

    def orthogonalize(self, newton_schulz) -> None:
        self.work.wait()
        if self.pieces is not None:
            full = torch.cat(self.pieces)[: self.shape[0]]
            orthogonal = newton_schulz(full).to(torch.bfloat16)
            padded = torch.zeros((self.chunk * self.world, *self.shape[1:]), dtype=torch.bfloat16, device=full.device)
            padded[: self.shape[0]] = orthogonal
            self.pieces = list(padded.chunk(self.world))

    def scatter(self) -> None:
        self.work = dist.scatter(self.mine, self.pieces, src=self._global(self.owner), group=self.group, async_op=True)

    def result(self) -> Tensor:
        self.work.wait()
        return self.mine[: self.rows.shape[0]]
