"""A deterministic discrete-event simulator of a pdcache deployment (`pdcache sim`).

It drives pdcache's own policy code (radix trees, eviction policies, the write policy, the
router's pair selector and admission) with modelled compute and I/O costs (`profile.py`);
docs/simulator.md says what is modelled and what is not. Modules: `profile` (the cost file),
`events` (the clock), `io` (bandwidth pipes, the shared store's time), `store` (its
contents), `cache` (a node's real trees), `nodes` (prefill / decode / unified compute),
`router`, `simulation` (one run), `report`, `command`.
"""
