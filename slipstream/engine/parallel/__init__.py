"""The parallelisms beyond data parallel: the mesh, and ``parallelize`` (parallelize.py) over pipeline,
expert, tensor (+ sequence), Ulysses / context and activation checkpointing."""

from slipstream.engine.parallel.mesh import DENSE, Mesh, coordinates, partition

__all__ = ["DENSE", "Mesh", "coordinates", "partition"]
