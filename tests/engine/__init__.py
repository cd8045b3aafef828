"""Tests of pdcache.engine: model, pool, radix tree, scheduler, sampler, engine loop."""
