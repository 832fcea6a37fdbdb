"""The worker: owns one pool's physical KV memory and serves the data plane over gRPC.

Layers: ``config`` (settings), ``pool`` (the KV tensors and every check on a request's
values), ``tensors`` (wire format), ``servicer`` (proto <-> pool), ``server`` (gRPC
server, registration with the allocator, heartbeats), ``cli`` (``python -m worker``).
"""
