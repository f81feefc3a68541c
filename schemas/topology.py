"""The fabric's shape: node → NIC rails → leaf switches → spine switches.

A rail-optimised two-tier fat-tree is the shape this model is written for (NVIDIA
SuperPOD-style): NIC ``r`` of every node in a pod plugs into the pod's rail-``r`` leaf, and
every leaf has uplinks to the spines. Traffic between two nodes on the same rail of the same
pod stays on its leaf; traffic to another pod climbs to a spine, and *which* spine is the
choice ECMP hashing makes blindly and a path planner makes on purpose.

A topology is read from a YAML or JSON file (:func:`load_topology`, see
``deploy/topology/example.yaml``) or, when the operator has none, inferred
(:func:`infer_topology`: nodes in name order, ``nodes_per_leaf`` to a pod, rail ``r`` of
every node on leaf ``r`` of its pod, each leaf wired to every spine).

>>> topo = infer_topology(["n0", "n1", "n2", "n3"], rails=2, nodes_per_leaf=2, spines=2)
>>> topo.leaf_of("n2", 1), len(topo.uplinks)
('pod1-rail1', 8)
>>> topo.node("n3").nics[0].device
'mlx5_0'
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "NicRail",
    "Topology",
    "TopologyError",
    "TopologyNode",
    "Uplink",
    "infer_topology",
    "load_topology",
]

Name = Annotated[str, Field(min_length=1, max_length=253)]
Gbps = Annotated[float, Field(gt=0, le=100_000)]


class TopologyError(ValueError):
    """A topology file that cannot be read or does not describe a usable fabric."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


class NicRail(_Model):
    """One NIC of a node: which rail it is on and which leaf it plugs into."""

    rail: Annotated[int, Field(ge=0, le=64)]
    device: Name = Field(description="RDMA device, e.g. mlx5_0 (the NCCL_IB_HCA name)")
    leaf: Name
    gbps: Gbps = 400.0


class TopologyNode(_Model):
    name: Name
    pod: Name | None = None
    nics: list[NicRail] = Field(min_length=1, max_length=64)


class Uplink(_Model):
    """A leaf → spine link (full duplex). ``capacity_factor`` < 1: degraded; 0: drained/down."""

    leaf: Name
    spine: Name
    gbps: Gbps = 400.0
    capacity_factor: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0

    @property
    def name(self) -> str:
        return f"{self.leaf}->{self.spine}"

    @property
    def effective_gbps(self) -> float:
        return self.gbps * self.capacity_factor


class Topology(_Model):
    """A two-tier leaf-spine fabric; every leaf a NIC plugs into must have an uplink."""

    name: Name = "fabric"
    nodes: list[TopologyNode] = Field(min_length=1, max_length=1_000_000)
    uplinks: list[Uplink] = Field(default_factory=list, max_length=10_000_000)

    @model_validator(mode="after")
    def _consistent(self) -> Topology:
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError("node names must be unique")
        wired = {u.leaf for u in self.uplinks}
        leaves = {nic.leaf for node in self.nodes for nic in node.nics}
        for node in self.nodes:
            rails = [nic.rail for nic in node.nics]
            if len(set(rails)) != len(rails):
                raise ValueError(f"node {node.name!r} has two NICs on one rail")
            missing = {nic.leaf for nic in node.nics} - wired
            if missing and len(leaves) > 1:  # one leaf alone needs no spine
                raise ValueError(
                    f"leaf {sorted(missing)[0]!r} (of node {node.name!r}) has no uplink: "
                    "add its leaf->spine links under 'uplinks'"
                )
        return self

    @cached_property
    def _by_name(self) -> dict[str, TopologyNode]:
        return {n.name: n for n in self.nodes}

    def node(self, name: str) -> TopologyNode:
        try:
            return self._by_name[name]
        except KeyError:
            raise TopologyError(
                f"node {name!r} is not in topology {self.name!r}; add it to the topology file "
                "or let Guard infer one (no --topology)"
            ) from None

    def leaf_of(self, node: str, rail: int) -> str:
        for nic in self.node(node).nics:
            if nic.rail == rail:
                return nic.leaf
        raise TopologyError(f"node {node!r} has no NIC on rail {rail}")

    @property
    def rails(self) -> int:
        return max(len(n.nics) for n in self.nodes)

    @property
    def spines(self) -> list[str]:
        return sorted({u.spine for u in self.uplinks})

    def with_capacity(self, factors: dict[str, float]) -> Topology:
        """A copy with some uplinks (by ``leaf->spine`` name) degraded or drained."""
        uplinks = [
            u.model_copy(update={"capacity_factor": factors[u.name]}) if u.name in factors else u
            for u in self.uplinks
        ]
        return self.model_copy(update={"uplinks": uplinks})


def infer_topology(
    nodes: Sequence[str],
    rails: int = 8,
    nodes_per_leaf: int = 32,
    spines: int = 16,
    nic_gbps: float = 400.0,
    uplink_gbps: float | None = None,
) -> Topology:
    """The default when no topology file is given: a rail-optimised, non-blocking fat-tree.

    Nodes are taken in the order given (sort them by name for racks numbered in order);
    ``nodes_per_leaf`` consecutive nodes form a pod; rail ``r`` of every node of pod ``p``
    plugs into leaf ``pod{p}-rail{r}``; every leaf has one uplink to each spine, sized so that
    uplinks carry what the leaf's NICs can send (``nodes_per_leaf * nic_gbps / spines``).
    """
    if rails < 1 or nodes_per_leaf < 1 or spines < 1:
        raise TopologyError("rails, nodes_per_leaf and spines must be at least 1")
    up = uplink_gbps if uplink_gbps is not None else nodes_per_leaf * nic_gbps / spines
    topo_nodes = []
    for i, name in enumerate(nodes):
        pod = f"pod{i // nodes_per_leaf}"
        nics = [
            NicRail(rail=r, device=f"mlx5_{r}", leaf=f"{pod}-rail{r}", gbps=nic_gbps)
            for r in range(rails)
        ]
        topo_nodes.append(TopologyNode(name=name, pod=pod, nics=nics))
    pods = (len(nodes) + nodes_per_leaf - 1) // nodes_per_leaf
    uplinks = [
        Uplink(leaf=f"pod{p}-rail{r}", spine=f"spine{s}", gbps=up)
        for p in range(pods)
        for r in range(rails)
        for s in range(spines)
    ]
    return Topology(name="inferred", nodes=topo_nodes, uplinks=uplinks)


def load_topology(path: str | Path) -> Topology:
    """Read a topology from ``.yaml``/``.yml`` (needs PyYAML) or ``.json``."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TopologyError(f"cannot read topology file {path}: {exc.strerror}") from None
    data: Any
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise TopologyError(
                f"{path} is YAML but PyYAML is not installed: `pip install pyyaml`, "
                "or write the topology as JSON"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise TopologyError(f"{path} is not valid YAML: {exc}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TopologyError(f"{path} is not valid JSON: {exc}") from None
    try:
        return Topology.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "top level"
        raise TopologyError(f"{path}: {where}: {first.get('msg')}") from None
