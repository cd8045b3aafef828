"""Tests of pdcache.offload_manager: HiCache tiers, host pool, IO workers, decode offload."""
