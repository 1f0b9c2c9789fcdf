"""Parallelism beyond data parallel: the mesh today; tensor, sequence, context, pipeline and expert later."""

from slipstream.engine.parallel.mesh import DENSE, Mesh, coordinates, partition

__all__ = ["DENSE", "Mesh", "coordinates", "partition"]
