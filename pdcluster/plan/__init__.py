"""The planner: profile the engine, simulate a cluster, size prefill:decode for SLOs (`pdcluster plan`)."""
