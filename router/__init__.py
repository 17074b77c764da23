"""The router: gRPC front, worker choice, the Redis prefix index."""
