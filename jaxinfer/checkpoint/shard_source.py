"""One device's slice of a params leaf, read from memory-mapped HF tensors
(`Reader.slice_of`, what `jax.make_array_from_callback` asks): only that device's rows
or row segments are touched, fused and expert leaves built on the fly; `ReadLog` counts
the bytes each call read, per leaf, for the tests. See
docs/parallelism.md#tensor-parallelism and docs/moe.md (#parameters-one-table, #gpt-oss).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model import fusion

Index = tuple[slice, ...]


@dataclasses.dataclass
class ReadLog:
    """Bytes of HF tensor data each callback asked for: (leaf path, index, bytes)."""

    reads: list[tuple[str, Index, int]] = dataclasses.field(default_factory=list)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def record(self, path: str, index: Index, nbytes: int) -> None:
        with self._lock:
            self.reads.append((path, index, nbytes))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one leaf comes from: HF tensor names and how they combine."""

    kind: str  # "plain" (same axes), "transposed", "qkv", "gate_up"
    names: tuple[str, ...]  # HF tensors: one, or (q, k, v), or (gate, up)
    experts: int = 0  # > 0: a stack of that many experts' leaves, `names` with "{e}"


def _bounds(index: slice, size: int) -> tuple[int, int]:
    start, stop, step = index.indices(size)
    if step != 1:
        raise ValueError(f"strided shard index {index} is not supported")
    return start, stop


class Reader:
    """Cuts leaf slices out of memory-mapped HF tensors (`tensors`: name -> array)."""

    def __init__(self, tensors: dict[str, np.ndarray], served: ModelConfig,
                 replicas: int, log: ReadLog | None = None) -> None:
        self.tensors, self.served, self.replicas = tensors, served, replicas
        self.log = log

    def _rows(self, name: str, start: int, stop: int, cols: slice = slice(None)) -> np.ndarray:
        part = np.array(self.tensors[name][start:stop, cols] if self.tensors[name].ndim == 2
                        else self.tensors[name][start:stop])
        self._read_bytes += part.nbytes
        return part

    def slice_of(self, path: str, layout: Layout, shape: tuple[int, ...], index: Index,
                 dtype: np.dtype) -> np.ndarray:
        """The `index` part of the leaf at `path` (its full shape `shape`), as `dtype`."""
        self._read_bytes = 0
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        builders: dict[str, Callable[..., np.ndarray]] = {
            "plain": self._plain, "transposed": self._transposed, "qkv": self._qkv,
            "gate_up": self._gate_up, "gate_up_rows": self._gate_up_rows,
            "interleaved_gate_up": self._interleaved_gate_up,
            "experts_transposed": self._experts_transposed}
        if layout.kind not in builders:
            raise ValueError(f"{path}: unknown layout kind {layout.kind!r}")
        if layout.experts:  # the first axis picks experts: read only those
            start, stop = _bounds(index[0], shape[0])
            out = np.stack([builders[layout.kind](
                tuple(n.format(e=e) for n in layout.names), shape[1:], index[1:]
            ).astype(dtype) for e in range(start, stop)])
        else:
            out = builders[layout.kind](layout.names, shape, index).astype(dtype)
        if self.log is not None:
            self.log.record(path, index, self._read_bytes)
        return out

    def _plain(self, names: tuple[str, ...], shape: tuple[int, ...], index: Index
               ) -> np.ndarray:
        start, stop = _bounds(index[0], shape[0])
        return self._rows(names[0], start, stop, *index[1:])

    def _transposed(self, names: tuple[str, ...], shape: tuple[int, ...], index: Index
                    ) -> np.ndarray:
        # ours [in, out] = HF [out, in].T: our column range is a range of HF rows
        start, stop = _bounds(index[1], shape[1])
        return self._rows(names[0], start, stop, index[0]).T

    def _qkv(self, names: tuple[str, ...], shape: tuple[int, ...], index: Index
             ) -> np.ndarray:
        cfg, h = self.served, self.served.head_dim
        r = cfg.num_heads // cfg.num_kv_heads
        width = (r + 2) * h  # fused columns per KV-head group
        axis = len(shape) - 1  # 1-D bias or 2-D [D, cols]
        start, stop = _bounds(index[axis], shape[axis])
        if start % width or stop % width:
            raise ValueError(f"a q/k/v shard [{start}, {stop}) must hold whole KV-head "
                             f"groups of {width} columns")
        rows = index[0] if axis == 1 else slice(None)
        q, k, v = names
        parts = []
        for group in range(start // width, stop // width):
            head = group // self.replicas  # the checkpoint's KV head for this group
            parts += [self._rows(q, group * r * h, (group + 1) * r * h, rows),
                      self._rows(k, head * h, (head + 1) * h, rows),
                      self._rows(v, head * h, (head + 1) * h, rows)]
        fused = np.concatenate(parts, axis=0)  # [cols, D] or [cols]
        return fused.T if axis == 1 else fused

    def _gate_up_rows(self, names: tuple[str, ...], shape: tuple[int, ...], index: Index
                      ) -> np.ndarray:
        """[2F, I] from gate and up [F, I] as stored: their rows interleaved in blocks."""
        return self._gate_up(names, shape[:1], index[:1], cols=index[1])

    def _gate_up(self, names: tuple[str, ...], shape: tuple[int, ...], index: Index,
                 cols: slice | None = None) -> np.ndarray:
        axis = len(shape) - 1  # 2-D [D, 2F], or 1-D [2F] (a fp8 weight's scales)
        block = fusion.mlp_block(shape[axis] // 2)  # F of this leaf: dense, expert, shared
        start, stop = _bounds(index[axis], shape[axis])
        if start % (2 * block) or stop % (2 * block):
            raise ValueError(f"a gate/up shard [{start}, {stop}) must hold whole block "
                             f"pairs of {2 * block} columns")
        gate, up = names
        first, last = start // 2, stop // 2  # gate and up rows [first, last)
        rows = index[:1] if axis == 1 else () if cols is None else (cols,)
        pair = np.stack([self._rows(gate, first, last, *rows),
                         self._rows(up, first, last, *rows)])  # [2, rows, D] or [2, rows]
        pair = pair.reshape(2, (last - first) // block, block, *pair.shape[2:]).swapaxes(0, 1)
        fused = pair.reshape(2 * (last - first), *pair.shape[3:])
        return fused.T if axis == 1 else fused

    def _stacked(self, name: str, index: Index) -> np.ndarray:
        """`index` of one tensor of all experts, read and counted."""
        part = np.asarray(self.tensors[name][index])
        self._read_bytes += part.nbytes
        return part

    def _interleaved_gate_up(self, names: tuple[str, ...], shape: tuple[int, ...],
                             index: Index) -> np.ndarray:
        """Our [E, 2F, I] (or biases [E, 2F]) in blocks, from HF's [E, I, 2F] (or
        [E, 2F]) whose even columns are gate and odd ones up."""
        block = fusion.mlp_block(shape[1] // 2)
        start, stop = _bounds(index[1], shape[1])
        if start % (2 * block) or stop % (2 * block):
            raise ValueError(f"a gate/up shard [{start}, {stop}) must hold whole block "
                             f"pairs of {2 * block} rows")
        # block pairs [start, stop) hold gate/up columns f in [start / 2, stop / 2): HF's
        # interleaved columns [start, stop)
        hf_index = (index[0], *index[2:], slice(start, stop))
        part = self._stacked(names[0], hf_index)  # [e, (I,) 2f] interleaved
        pairs = part.reshape(*part.shape[:-1], (stop - start) // (2 * block), block, 2)
        fused = np.moveaxis(pairs, -1, -2).reshape(part.shape)  # [.., f/B, 2, B]
        return fused.swapaxes(-1, -2) if fused.ndim == 3 else fused

    def _experts_transposed(self, names: tuple[str, ...], shape: tuple[int, ...],
                            index: Index) -> np.ndarray:
        """Our [E, O, I] from HF's [E, I, O]."""
        return self._stacked(names[0], (index[0], index[2], index[1])).swapaxes(-1, -2)
