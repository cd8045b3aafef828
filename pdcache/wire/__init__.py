"""The HTTP API as the servers and the router both speak it (docs/design.md §3, §4.1): request
and answer models, errors, SSE framing, mounting, the service-endpoint vocabulary, the series
both expose, serving, detokenisation and the agent API's parsers. Nothing here holds an
engine; the engine-facing server is `pdcache.server`."""
