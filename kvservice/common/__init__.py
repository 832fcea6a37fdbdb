"""What both sides of the wire share: gRPC server helpers, the error interceptor, settings
loading and checks, the pool geometry, and the metrics catalogue.

Nothing here imports the allocator service, the engine, the tools, torch or CuPy, so the
SDK and the workers can use all of it.
"""
