"""The runtime both sides of the wire run on: binary frames, the iroh transport, SWIM
membership, the name registry, nodes and actors, child processes. It knows nothing above it."""
