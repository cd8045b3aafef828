"""Prefill → decode KV transfer: ZeroMQ control plane, room state machines, data engines.

Prefill nodes use `pdcache.transfer.sender.KVSender`, decode nodes
`pdcache.transfer.receiver.KVReceiver`; both take one frozen `pdcache.transfer.config.
TransferConfig`. See docs/design.md §4.5 and the module docstrings for the protocol.

Importing the package imports nothing: its modules are imported by name, so the torch-free
ones (`config`, whose `TransferSettings` the topology schema inherits; `messages`, `errors`)
load without the sender and receiver, which need torch.
"""
