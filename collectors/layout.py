"""A rank's place in the job's parallel layout: its data-parallel rank, pipeline stage, tensor- and
context-parallel rank (`ranks.dp_rank, pp_stage, tp_rank, cp_rank`) and the job's degrees
(`runs.dp_size, pp_size, tp_size, cp_size`).

Read from, in this order:

- `perfscope.profile(parallel={"dp": 2, "pp": 2, "tp": 1})`: the degrees, as the dimensions of a
  device mesh in the order given, the last varying fastest (what `init_device_mesh` does with
  `mesh_dim_names=("dp", "pp", "tp")`): rank r's coordinates are r written in that mixed radix;
- `perfscope.profile(parallel=mesh)`, a `torch.distributed.device_mesh.DeviceMesh`: its
  `mesh_dim_names` ("dp", "pp", "tp", "cp"; torchtitan's "dp_replicate" and "dp_shard" together make
  the data-parallel dimension) and this rank's `get_coordinate()`;
- without `parallel=`, Megatron-LM's `megatron.core.parallel_state` when the job imported it and
  initialised its model parallelism (its get_data_parallel_rank, get_pipeline_model_parallel_rank ...).

Otherwise the layout is not recorded (NULL): a job that only does data parallelism is read as such by
the analyses from its communication (every collective on the whole world, no point-to-point), and
writing dp_rank = rank without knowing would mislabel a pipeline whose stages the recorder cannot see.
A layout whose degrees do not multiply to the world size, or that cannot be read, is one warning and
NULL coordinates; the job is never stopped for it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

#: the dimensions, in the order of the columns
DIMS = ("dp", "pp", "tp", "cp")


class LayoutError(ValueError):
    """A layout that cannot be used: the message says why, in one line."""


@dataclass(frozen=True)
class Layout:
    """Coordinates of one rank (index by DIMS) and the job's degrees; `source` says where they came
    from ('parallel', 'mesh', 'megatron')."""

    coords: tuple[int, int, int, int]
    sizes: tuple[int, int, int, int]
    source: str

    def rank_columns(self) -> tuple[int, int, int, int]:
        """ranks.dp_rank, pp_stage, tp_rank, cp_rank"""
        return self.coords

    def run_columns(self) -> dict[str, int]:
        """runs.dp_size, pp_size, tp_size, cp_size"""
        return {f"{d}_size": s for d, s in zip(DIMS, self.sizes, strict=True)}


def _dim(name: str) -> str | None:
    key = name.lower()
    for d in DIMS:
        if key == d or key.startswith(d + "_"):  # dp_replicate, dp_shard (torchtitan)
            return d
    return None


def _combine(dims: list[tuple[str, int, int]], rank: int, world: int, source: str) -> Layout:
    """(dimension, size, coordinate) per mesh dimension, outermost first -> a Layout. Dimensions of
    the same kind combine (outer one most significant); absent ones are size 1, coordinate 0."""
    size = {d: 1 for d in DIMS}
    coord = {d: 0 for d in DIMS}
    for d, n, c in dims:
        size[d] *= n
        coord[d] = coord[d] * n + c
    total = 1
    for d in DIMS:
        total *= size[d]
    if total != world:
        shape = " x ".join(f"{d}={n}" for d, n, _ in dims) or "none"
        raise LayoutError(f"its degrees ({shape}) multiply to {total}, not the world size {world}")
    return Layout(tuple(coord[d] for d in DIMS), tuple(size[d] for d in DIMS), source)  # type: ignore[arg-type]


def from_degrees(parallel: Any, rank: int, world: int) -> Layout:
    """parallel={"dp": 2, "pp": 2}: a mesh of these dimensions in the order given, last fastest."""
    items = list(parallel.items())
    unknown = [str(k) for k, _ in items if _dim(str(k)) is None]
    if unknown:
        raise LayoutError(f"unknown dimension {', '.join(unknown)} (use dp, pp, tp, cp)")
    bad = [f"{k}={v!r}" for k, v in items if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        raise LayoutError(f"degrees must be positive integers, not {', '.join(bad)}")
    total = 1
    for _, n in items:
        total *= n
    dims: list[tuple[str, int, int]] = []
    rest = rank
    stride = total
    for k, n in items:
        stride //= n
        dims.append((_dim(str(k)) or "", n, (rest // stride) % n if stride else 0))
    return _combine(dims, rank, world, "parallel")


def from_mesh(mesh: Any, rank: int, world: int) -> Layout:
    """A DeviceMesh: its dimension names and this rank's coordinate in it."""
    names = getattr(mesh, "mesh_dim_names", None)
    if not names:
        raise LayoutError("the DeviceMesh has no mesh_dim_names (name them dp, pp, tp, cp)")
    unknown = [str(n) for n in names if _dim(str(n)) is None]
    if unknown:
        raise LayoutError(f"unknown mesh dimension {', '.join(unknown)} (use dp, pp, tp, cp)")
    shape = tuple(int(n) for n in mesh.mesh.shape)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise LayoutError(f"rank {rank} is not in the DeviceMesh")
    dims = [(_dim(str(n)) or "", s, int(c)) for n, s, c in zip(names, shape, coordinate, strict=True)]
    return _combine(dims, rank, world, "mesh")


#: Megatron-LM's parallel_state functions: dimension -> (rank function, size function)
MEGATRON = {
    "dp": ("get_data_parallel_rank", "get_data_parallel_world_size"),
    "pp": ("get_pipeline_model_parallel_rank", "get_pipeline_model_parallel_world_size"),
    "tp": ("get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size"),
    "cp": ("get_context_parallel_rank", "get_context_parallel_world_size"),
}


def from_megatron(rank: int, world: int) -> Layout | None:
    """Megatron's parallel_state, when the job imported it and initialised model parallelism; else
    None. A function it lacks (an older Megatron without context parallelism) is degree 1."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None:
        return None
    ready = getattr(ps, "model_parallel_is_initialized", None)
    try:
        if not callable(ready) or not ready():
            return None
    except Exception:
        return None
    dims = []
    for d, (rank_fn, size_fn) in MEGATRON.items():
        get_rank, get_size = getattr(ps, rank_fn, None), getattr(ps, size_fn, None)
        if get_rank is None or get_size is None:
            if d == "dp":  # no data-parallel rank: not a parallel_state perfscope can read
                raise LayoutError(f"megatron.core.parallel_state has no {rank_fn}")
            continue
        try:
            dims.append((d, int(get_size()), int(get_rank())))
        except Exception as exc:
            raise LayoutError(f"parallel_state.{rank_fn} failed ({type(exc).__name__})") from None
    return _combine(dims, rank, world, "megatron")


def resolve(parallel: Any, rank: int, world: int) -> Layout | None:
    """This rank's layout from `parallel` (degrees or a DeviceMesh), else Megatron's parallel_state,
    else None (unknown). Raises LayoutError, one line, for a layout that cannot be used."""
    if parallel is None:
        return from_megatron(rank, world)
    if isinstance(parallel, dict):
        return from_degrees(parallel, rank, world)
    if hasattr(parallel, "get_coordinate") and hasattr(parallel, "mesh"):
        return from_mesh(parallel, rank, world)
    raise LayoutError(f"parallel= takes a dict of degrees or a DeviceMesh, not {type(parallel).__name__}")
