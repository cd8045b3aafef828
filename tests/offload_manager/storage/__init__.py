"""Tests of pdcache.offload_manager.storage: the storage backends, format, CLI."""
