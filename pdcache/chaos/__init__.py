"""`pdcache chaos`: a fault-injecting soak checked token by token against an oracle.

A fault harness (mounts, network namespaces, signals), not a benchmark: it drives the stack
with bench's launcher (`pdcache.bench.stack`) and session player (`pdcache.bench.replay_run`).
"""
