"""Built-in load-state-dict pre-hooks whose whole state is JSON: TP shard, dedup, alias.

All three use the standard pre-hook signature
``(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)``
and address keys as ``prefix + key``, so the same hook works registered on the
module that owns the parameter (short key) or on the root (full dotted key).
Each has ``to_spec()`` / ``from_spec()`` so the hook registry stores it as JSON
and rebuilds an equal hook; ``__eq__`` compares that state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from adstore.integration.errors import ConfigError

__all__ = ["TPShardHook", "DedupHook", "AliasHook"]


def _key(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(field, f"expected a non-empty state-dict key, got {value!r}")
    return value


def _int(value: Any, field: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(field, f"expected an integer >= {minimum}, got {value!r}")
    return value


class _SpecHook:
    def to_spec(self) -> dict[str, Any]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.to_spec() == self.to_spec()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, repr(sorted(self.to_spec().items()))))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.to_spec().items())
        return f"{type(self).__name__}({args})"


class TPShardHook(_SpecHook):
    """Replace a full tensor-parallel weight by this rank's contiguous slice along ``dim``.

    Applies only when ``prefix + param_key`` is present with exactly the full
    ``shape`` (so an already-sharded or unrelated checkpoint passes through).
    With ``fused_dims`` the dimension is a concatenation of blocks (fused q/k/v,
    gate/up): each block is split on its own and this rank's pieces are
    concatenated, which keeps every rank's heads together.  Every local block
    size must be a whole multiple of ``min_local_shape`` (e.g. ``head_dim``);
    the divisibility is checked when the hook is built, with a clear error.
    """

    def __init__(
        self,
        param_key: str,
        shape: Sequence[int],
        dim: int,
        rank: int,
        world_size: int,
        min_local_shape: int = 1,
        fused_dims: Sequence[int] | None = None,
    ) -> None:
        self.param_key = _key(param_key, "param_key")
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
            raise ConfigError("shape", f"expected a sequence of ints, got {shape!r}")
        self.shape = tuple(_int(s, "shape") for s in shape)
        if isinstance(dim, bool) or not isinstance(dim, int) or not -len(self.shape) <= dim < len(self.shape):
            raise ConfigError("dim", f"{dim!r} is not a dimension of shape {self.shape}")
        self.dim = dim % len(self.shape)
        self.world_size = _int(world_size, "world_size", minimum=1)
        self.rank = _int(rank, "rank")
        if self.rank >= self.world_size:
            raise ConfigError("rank", f"rank {rank} is outside world size {world_size}")
        self.min_local_shape = _int(min_local_shape, "min_local_shape", minimum=1)
        full = self.shape[self.dim]
        if fused_dims is None:
            self.fused_dims = None
            blocks: tuple[int, ...] = (full,)
        else:
            self.fused_dims = tuple(_int(b, "fused_dims", minimum=1) for b in fused_dims)
            blocks = self.fused_dims
            if sum(blocks) != full:
                raise ConfigError("fused_dims", f"blocks {blocks} sum to {sum(blocks)}, not dim {self.dim} size {full}")
        for b in blocks:
            if b % self.world_size:
                raise ConfigError(
                    "shape",
                    f"{self.param_key}: size {b} along dim {self.dim} is not divisible by world size {self.world_size}",
                )
            if (b // self.world_size) % self.min_local_shape:
                raise ConfigError(
                    "min_local_shape",
                    f"{self.param_key}: local size {b // self.world_size} along dim "
                    f"{self.dim} is not a multiple of {self.min_local_shape}",
                )
        self._blocks = blocks

    @property
    def local_shape(self) -> tuple[int, ...]:
        out = list(self.shape)
        out[self.dim] = self.shape[self.dim] // self.world_size
        return tuple(out)

    def shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full ``tensor``, always a new contiguous tensor.

        Never a view: a parameter loaded with ``assign=True`` would otherwise keep
        the whole checkpoint tensor alive, which is what sharding is meant to avoid.
        """
        pieces = []
        offset = 0
        for b in self._blocks:
            local = b // self.world_size
            pieces.append(tensor.narrow(self.dim, offset + self.rank * local, local))
            offset += b
        if len(pieces) == 1:
            return pieces[0].clone(memory_format=torch.contiguous_format)
        return torch.cat(pieces, dim=self.dim)

    def __call__(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        key = prefix + self.param_key
        tensor = state_dict.get(key)
        if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) == self.shape:
            state_dict[key] = self.shard(tensor)

    def to_spec(self) -> dict[str, Any]:
        return {
            "param_key": self.param_key,
            "shape": list(self.shape),
            "dim": self.dim,
            "rank": self.rank,
            "world_size": self.world_size,
            "min_local_shape": self.min_local_shape,
            "fused_dims": None if self.fused_dims is None else list(self.fused_dims),
        }

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> TPShardHook:
        return cls(
            spec["param_key"],
            spec["shape"],
            spec["dim"],
            spec["rank"],
            spec["world_size"],
            spec.get("min_local_shape", 1),
            spec.get("fused_dims"),
        )


class DedupHook(_SpecHook):
    """Tied / duplicated parameters that export kept once.

    ``kept_key`` is the parameter the module still has; ``removed_keys`` are its
    duplicates.  If the checkpoint lacks ``kept_key`` it is filled from the first
    present removed key (a checkpoint that stored only the tied twin).  Then
    ``mode="drop"`` removes the duplicates (they are not parameters any more, so
    they would be unexpected keys) and ``mode="copy"`` writes the kept tensor into
    every removed key (modules that keep both names).
    """

    def __init__(self, kept_key: str, removed_keys: Sequence[str], mode: str = "drop") -> None:
        self.kept_key = _key(kept_key, "kept_key")
        if isinstance(removed_keys, str) or not removed_keys:
            raise ConfigError("removed_keys", f"expected a non-empty list of keys, got {removed_keys!r}")
        self.removed_keys = tuple(_key(k, "removed_keys") for k in removed_keys)
        if mode not in ("drop", "copy"):
            raise ConfigError("mode", f"expected 'drop' or 'copy', got {mode!r}")
        self.mode = mode

    def __call__(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        kept = prefix + self.kept_key
        if kept not in state_dict:
            for r in self.removed_keys:
                if prefix + r in state_dict:
                    state_dict[kept] = state_dict[prefix + r]
                    break
        for r in self.removed_keys:
            if self.mode == "drop":
                state_dict.pop(prefix + r, None)
            elif kept in state_dict:
                state_dict[prefix + r] = state_dict[kept]

    def to_spec(self) -> dict[str, Any]:
        return {"kept_key": self.kept_key, "removed_keys": list(self.removed_keys), "mode": self.mode}

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> DedupHook:
        return cls(spec["kept_key"], spec["removed_keys"], spec.get("mode", "drop"))


class AliasHook(_SpecHook):
    """State-dict key aliases: a checkpoint key ``old`` is loaded as ``new``.

    When both names are present the module's own name (``new``) wins and the
    old key is dropped, so it never shows up as an unexpected key.
    """

    def __init__(self, aliases: Mapping[str, str] | None = None, /, **kw: str) -> None:
        merged = dict(aliases or {}, **kw)
        if not merged:
            raise ConfigError("aliases", "expected at least one old -> new key alias")
        self.aliases = {_key(o, "aliases"): _key(n, "aliases") for o, n in merged.items()}

    def __call__(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        for old, new in self.aliases.items():
            if prefix + old in state_dict:
                value = state_dict.pop(prefix + old)
                state_dict.setdefault(prefix + new, value)

    def to_spec(self) -> dict[str, Any]:
        return {"aliases": dict(self.aliases)}

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> AliasHook:
        aliases = spec["aliases"]
        if not isinstance(aliases, dict):
            raise ConfigError("aliases", "expected a mapping")
        return cls(aliases)
