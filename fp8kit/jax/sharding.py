"""Mesh axes for each kind of parallelism, Transformer Engine's logical axis names, and sharding constraints.

`from fp8kit.jax.sharding import MeshResource` where a Transformer Engine user imports it from
`transformer_engine.jax.sharding`. `MeshResource` names the mesh axes used for data, tensor, FSDP, pipeline, ...
parallelism; `te.autocast(mesh_resource=...)` (or `global_shard_guard`) makes it current. The logical axis names
below (`BATCH_AXES`, `W_TP_AXES`, ...) annotate the layers' activations and weights; `extend_logical_axis_rules`
(in fp8kit.jax.flax) maps them to the current MeshResource's axes for `flax.linen.logical_axis_rules`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import jax
from jax.sharding import PartitionSpec

from . import settings

__all__ = [
    "BATCH_AXES", "SEQLEN_AXES", "SEQLEN_TP_AXES", "SEQLEN_CP_AXES", "HEAD_AXES", "HIDDEN_AXES", "HIDDEN_TP_AXES",
    "JOINED_AXES", "W_NO_SHARD_AXES", "W_FSDP_AXES", "W_TP_AXES", "W_JOINED_AXES",
    "MeshResource", "global_shard_guard", "global_mesh_resource", "current_mesh_resource",
    "get_mesh", "is_mesh_available", "get_all_mesh_axes", "get_mesh_axis_size",
    "get_sharding_map_logic_axis_to_mesh_axis", "with_sharding_constraint", "with_sharding_constraint_by_logical_axes",
]

# logical axis names (the values are Transformer Engine's, so rules written for it apply)
BATCH_AXES = "nvte_batch"
SEQLEN_AXES = "nvte_seqlen"
SEQLEN_TP_AXES = "nvte_seqlen_tp"
SEQLEN_CP_AXES = "nvte_seqlen_cp"
HEAD_AXES = "nvte_head"
HIDDEN_AXES = "nvte_hidden"
HIDDEN_TP_AXES = "nvte_hidden_tp"
JOINED_AXES = "nvte_joined"
W_NO_SHARD_AXES = "nvte_w_no_shard"
W_FSDP_AXES = "nvte_w_fsdp"
W_TP_AXES = "nvte_w_tp"
W_JOINED_AXES = "nvte_w_joined"


@dataclasses.dataclass(frozen=True)
class MeshResource:
    """Names of the mesh axes used for each kind of parallelism (None: not used).

    dp_resource: data parallel (batch); tp_resource: tensor parallel (hidden); tpsp_resource: tensor and sequence
    parallel; fsdp_resource: fully sharded data parallel (batch and weights); pp_resource: pipeline stages;
    cp_resource: context parallel (sequence); ep_resource: expert parallel.

    Amaxes are all-reduced with MAX over every named axis except `pp_resource` (pipeline stages hold different
    layers, so their tensors are not shards of one tensor). Under `jax.jit` with sharded global arrays this happens
    by itself (the max of a global array is global); the names matter inside `shard_map`, where fp8kit calls
    `lax.pmax` over those of them that are bound.
    """

    dp_resource: Optional[str] = None
    tp_resource: Optional[str] = None
    tpsp_resource: Optional[str] = None
    fsdp_resource: Optional[str] = None
    pp_resource: Optional[str] = None
    cp_resource: Optional[str] = None
    ep_resource: Optional[str] = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{field.name}: expected a mesh axis name (str) or None, got {value!r}")

    @property
    def amax_axes(self) -> Tuple[str, ...]:
        """The axes amaxes are reduced over: every named axis except pipeline parallelism, without repeats."""
        names = (self.dp_resource, self.fsdp_resource, self.tp_resource, self.tpsp_resource, self.cp_resource,
                 self.ep_resource)
        out: List[str] = []
        for name in names:
            if name is not None and name != self.pp_resource and name not in out:
                out.append(name)
        return tuple(out)


@contextlib.contextmanager
def global_shard_guard(resource: Optional[MeshResource]) -> Iterator[None]:
    """Make `resource` the current MeshResource for the body (`te.autocast(mesh_resource=...)` does this too)."""
    if resource is not None and not isinstance(resource, MeshResource):
        raise ValueError(f"resource: expected a fp8kit.jax.sharding.MeshResource, got {type(resource).__name__}")
    with settings.scoped(settings.MESH_RESOURCE, resource):
        yield


def current_mesh_resource() -> MeshResource:
    """The current MeshResource, or an empty one (no parallelism) when none is set."""
    resource = settings.MESH_RESOURCE.get()
    return resource if resource is not None else MeshResource()


def global_mesh_resource() -> MeshResource:
    """The current MeshResource; raises ValueError when none is set (enter `te.autocast(mesh_resource=...)` or
    `global_shard_guard(MeshResource(...))`)."""
    resource = settings.MESH_RESOURCE.get()
    if resource is None:
        raise ValueError("no MeshResource is set: use te.autocast(..., mesh_resource=MeshResource(...)) or "
                         "fp8kit.jax.sharding.global_shard_guard(MeshResource()) around this code")
    return resource


def get_mesh():
    """The mesh in effect (`jax.set_mesh`), possibly empty."""
    return jax.sharding.get_abstract_mesh()


def is_mesh_available() -> bool:
    """True when a non-empty mesh is in effect."""
    mesh = get_mesh()
    return mesh is not None and not mesh.empty


def get_all_mesh_axes() -> Tuple[str, ...]:
    """The axis names of the mesh in effect (empty without one)."""
    mesh = get_mesh()
    return tuple(mesh.axis_names) if mesh is not None and not mesh.empty else ()


def get_mesh_axis_size(axis: Optional[str], mesh=None) -> int:
    """The size of mesh axis `axis` (1 for None); ValueError when the mesh has no such axis."""
    if axis is None:
        return 1
    mesh = get_mesh() if mesh is None else mesh
    if mesh is None or mesh.empty or axis not in mesh.axis_names:
        raise ValueError(f"axis {axis!r} is not an axis of the mesh in effect ({get_all_mesh_axes()})")
    return int(dict(zip(mesh.axis_names, mesh.axis_sizes))[axis])


def _enabled(axis: Optional[str]) -> bool:
    return axis is not None and get_mesh_axis_size(axis) > 1


def get_sharding_map_logic_axis_to_mesh_axis() -> Dict[str, Optional[str]]:
    """Logical axis name -> mesh axis under the current MeshResource ({} without a mesh): the batch goes to the
    FSDP axis when it has more than one device (else to the data axis), heads and tensor-parallel hidden to the
    tensor(-sequence) axis, FSDP-sharded weights to the FSDP axis."""
    if not is_mesh_available():
        return {}
    r = current_mesh_resource()
    tp = r.tpsp_resource if _enabled(r.tpsp_resource) else r.tp_resource
    return {
        BATCH_AXES: r.fsdp_resource if _enabled(r.fsdp_resource) else r.dp_resource,
        SEQLEN_AXES: None,
        SEQLEN_TP_AXES: r.tpsp_resource,
        SEQLEN_CP_AXES: r.cp_resource,
        HEAD_AXES: tp,
        HIDDEN_AXES: None,
        HIDDEN_TP_AXES: tp,
        JOINED_AXES: None,
        W_NO_SHARD_AXES: None,
        W_FSDP_AXES: r.fsdp_resource,
        W_TP_AXES: tp,
        W_JOINED_AXES: None,
    }


def with_sharding_constraint(x: jax.Array, pspec: Optional[PartitionSpec]) -> jax.Array:
    """`jax.lax.with_sharding_constraint(x, pspec)` when a mesh is in effect, without the axes `shard_map` made
    manual; a no-op without a mesh, for `pspec=None`, or when nothing is left to constrain."""
    if pspec is None or not is_mesh_available():
        return x
    manual = set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))

    def keep(entry):
        if isinstance(entry, tuple):
            rest = tuple(n for n in entry if n not in manual)
            return rest or None
        return None if entry in manual else entry

    cleaned = tuple(keep(e) for e in pspec)
    if all(e is None for e in cleaned):
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*cleaned))


def with_sharding_constraint_by_logical_axes(x: jax.Array, logical_axis_names: Optional[Sequence]) -> jax.Array:
    """Constrain `x` by logical axis names: through `flax.linen.logical_axis_rules` when rules are set, else through
    the table of `get_sharding_map_logic_axis_to_mesh_axis` (with a DeprecationWarning, as Transformer Engine).
    None or () means no constraint."""
    if not logical_axis_names:
        return x
    import flax.linen as nn

    if len(logical_axis_names) != x.ndim:
        raise ValueError(f"logical axes {tuple(logical_axis_names)} do not match an array of rank {x.ndim}")
    if nn.get_logical_axis_rules():
        return with_sharding_constraint(x, nn.logical_to_mesh_axes(tuple(logical_axis_names)))
    if not is_mesh_available():
        return x
    warnings.warn("fp8kit: no flax logical axis rules are set; mapping the layers' logical axes with the built-in "
                  "table. Use flax.linen.logical_axis_rules(fp8kit.jax.flax.extend_logical_axis_rules(...)).",
                  DeprecationWarning, stacklevel=2)
    table = get_sharding_map_logic_axis_to_mesh_axis()
    return with_sharding_constraint(x, PartitionSpec(*[table.get(n) for n in logical_axis_names]))
