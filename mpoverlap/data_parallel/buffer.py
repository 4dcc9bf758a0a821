"""Contiguous parameter and gradient buffers, cut into buckets for data-parallel reduction.

Every trainable parameter lives in one flat buffer `param_data[N]`, and its gradient in a
twin `grad_data[N]`: `param.data` is a view `param_data[start:end].view(shape)` and
`param.grad` a view of `grad_data` at the same offsets, so autograd accumulates straight into
the buffer and a bucket's communication is one collective over one contiguous slice.

Layout: parameters in REVERSE order of `module.named_parameters()`, because backward produces
gradients roughly last layer first; the first bucket therefore completes first. A bucket
closes as soon as it holds >= `bucket_mb` MiB (a parameter is never split), or when the next
parameter has another `key_of` (expert weights reduce over another group than dense ones, so
a bucket never mixes them), and is padded with zeros to a multiple of `pad_to[key]` (that
group's size under the distributed optimizer) so it reduce-scatters into equal shards:

    bucket b: [offset_b, offset_b + numel_b),   numel_b % pad_to == 0
    shard r of bucket b: [offset_b + r * numel_b / pad_to, offset_b + (r + 1) * numel_b / pad_to)

With `unit_of` a bucket also never spans two units (ZeRO-2/3: a unit is gathered, and its
gradients reduce-scattered, as a whole), and with `separate=True` every bucket gets storages
of its own instead of a slice of one flat buffer, so each can be freed and re-allocated on its
own (`free_storage` / `alloc_storage`); the offsets stay those of the flat layout, and
`param_data` / `grad_data` of the buffer are then None.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, Iterable, List, Optional, Tuple, Union

import torch
import torch.nn as nn

MIB = 1024 * 1024


@dataclass
class Bucket:
    """One contiguous slice of the buffers that is reduced by one collective.

    `params` are in buffer order (reverse model order); `param_data` / `grad_data` are 1-D
    views `[numel]` of the buffers, padding included (the last `numel - data_numel` elements).
    """

    index: int
    offset: int
    numel: int
    data_numel: int
    params: List[nn.Parameter]
    names: List[str]
    param_data: torch.Tensor
    grad_data: torch.Tensor
    key: Hashable = None  # which reduction group the bucket belongs to (see build_buffer)
    unit: Hashable = None  # the unit (ZeRO-3 gather granule) it belongs to, if any

    def shard_range(self, rank: int, world: int) -> Tuple[int, int]:
        """Global buffer range [lo, hi) of shard `rank` when the bucket is split `world` ways."""
        size = self.numel // world
        return self.offset + rank * size, self.offset + (rank + 1) * size


@dataclass
class ParamAndGradBuffer:
    """Flat buffers for `named_params`; see the module docstring for the layout.

    Attributes: `param_data[N]`, `grad_data[N]` (N = sum of padded bucket sizes), `buckets`,
    `index[param] -> (start, end, bucket_index)` in buffer elements, `name_of[param]`.
    """

    param_data: Optional[torch.Tensor]
    grad_data: Optional[torch.Tensor]
    buckets: List[Bucket]
    index: Dict[nn.Parameter, Tuple[int, int, int]] = field(default_factory=dict)
    name_of: Dict[nn.Parameter, str] = field(default_factory=dict)

    @property
    def params(self) -> List[nn.Parameter]:
        """Parameters in buffer order."""
        return [p for b in self.buckets for p in b.params]

    @property
    def numel(self) -> int:
        """Elements of the flat layout (padding included)."""
        last = self.buckets[-1]
        return last.offset + last.numel

    def grad_view(self, param: nn.Parameter) -> torch.Tensor:
        start, end, b = self.index[param]
        off = self.buckets[b].offset
        return self.buckets[b].grad_data[start - off:end - off].view(param.shape)

    def param_view(self, param: nn.Parameter) -> torch.Tensor:
        start, end, b = self.index[param]
        off = self.buckets[b].offset
        return self.buckets[b].param_data[start - off:end - off].view(param.shape)

    def zero_grad(self) -> None:
        if self.grad_data is not None:
            self.grad_data.zero_()
            return
        for b in self.buckets:
            if is_allocated(b.grad_data):
                b.grad_data.zero_()


def is_allocated(t: torch.Tensor) -> bool:
    """False once `free_storage(t)` released its memory (and until `alloc_storage(t)`)."""
    return t.untyped_storage().nbytes() > 0


def free_storage(t: torch.Tensor) -> None:
    """Release the memory of `t` (a tensor owning its whole storage); views of it keep their
    shapes and see the new memory after `alloc_storage` (FSDP's resharding trick)."""
    if is_allocated(t):
        t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> bool:
    """Give a freed `t` its memory back (uninitialised); True when it had to."""
    if is_allocated(t):
        return False
    t.untyped_storage().resize_(t.numel() * t.element_size())
    return True


def _plan_buckets(sizes: List[int], bucket_elems: int, keys: Optional[List[Hashable]] = None) -> List[List[int]]:
    """Group consecutive parameter indices; a bucket closes once it reaches `bucket_elems`
    or before a parameter whose key differs from the bucket's."""
    keys = keys if keys is not None else [None] * len(sizes)
    groups: List[List[int]] = []
    current: List[int] = []
    filled = 0
    for i, n in enumerate(sizes):
        if current and keys[i] != keys[current[0]]:
            groups.append(current)
            current, filled = [], 0
        current.append(i)
        filled += n
        if filled >= bucket_elems:
            groups.append(current)
            current, filled = [], 0
    if current:
        groups.append(current)
    return groups


def build_buffer(named_params: Iterable[Tuple[str, nn.Parameter]], *, bucket_mb: float,
                 pad_to: Union[int, Dict[Hashable, int]] = 1,
                 key_of: Optional[Callable[[nn.Parameter], Hashable]] = None,
                 unit_of: Optional[Callable[[nn.Parameter], Hashable]] = None,
                 separate: bool = False) -> ParamAndGradBuffer:
    """Move every trainable parameter of `named_params` (model order) into flat buffers.

    Parameters with `requires_grad=False` are left where they are (nothing to reduce or
    optimise). A Parameter reached under two names (tied weights) is placed once, under its
    first name. Values are copied into the buffer before `.data` is re-pointed, so the model
    is numerically unchanged; `.grad` becomes a zeroed view of the gradient buffer.
    """
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
    pad_of = pad_to if isinstance(pad_to, dict) else None
    if (min(pad_of.values()) if pad_of else pad_to) < 1:
        raise ValueError(f"pad_to must be >= 1, got {pad_to}")
    seen, ordered = set(), []
    for name, p in named_params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        ordered.append((name, p))
    if not ordered:
        raise ValueError("no trainable parameters to place in a data-parallel buffer")
    ordered.reverse()  # backward meets the last layers first
    dtypes = {p.dtype for _, p in ordered}
    devices = {p.device for _, p in ordered}
    if len(dtypes) != 1 or len(devices) != 1:
        raise TypeError(f"one buffer needs one dtype and device; got {dtypes} on {devices}")
    dtype, device = dtypes.pop(), devices.pop()
    elem_bytes = torch.empty((), dtype=dtype).element_size()
    bucket_elems = max(1, int(bucket_mb * MIB / elem_bytes))

    sizes = [p.numel() for _, p in ordered]
    keys = [key_of(p) if key_of is not None else None for _, p in ordered]
    units = [unit_of(p) if unit_of is not None else None for _, p in ordered]
    groups = _plan_buckets(sizes, bucket_elems, list(zip(keys, units)))
    # Offsets first, so the buffers are allocated once at their final size.
    spans, total = [], 0
    for group in groups:
        data_numel = sum(sizes[i] for i in group)
        pad = pad_of[keys[group[0]]] if pad_of is not None else pad_to
        numel = -(-data_numel // pad) * pad
        spans.append((total, numel, data_numel))
        total += numel
    param_data = None if separate else torch.zeros(total, dtype=dtype, device=device)
    grad_data = None if separate else torch.zeros(total, dtype=dtype, device=device)

    buffer = ParamAndGradBuffer(param_data=param_data, grad_data=grad_data, buckets=[])
    for b, (group, (offset, numel, data_numel)) in enumerate(zip(groups, spans)):
        start = offset
        if separate:
            b_param = torch.zeros(numel, dtype=dtype, device=device)
            b_grad = torch.zeros(numel, dtype=dtype, device=device)
        else:
            b_param, b_grad = param_data[offset:offset + numel], grad_data[offset:offset + numel]
        bucket = Bucket(index=b, offset=offset, numel=numel, data_numel=data_numel, params=[],
                        names=[], param_data=b_param, grad_data=b_grad, key=keys[group[0]],
                        unit=units[group[0]])
        for i in group:
            name, p = ordered[i]
            end = start + p.numel()
            view = b_param[start - offset:end - offset].view(p.shape)
            view.copy_(p.data)
            p.data = view
            p.grad = b_grad[start - offset:end - offset].view(p.shape)
            buffer.index[p] = (start, end, b)
            buffer.name_of[p] = name
            bucket.params.append(p)
            bucket.names.append(name)
            start = end
        buffer.buckets.append(bucket)
    return buffer
