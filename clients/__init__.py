"""The client side: the ClientApp (:mod:`clients.app`) and one handler module per method.

A handler takes a :class:`clients.job.ClientJob` (the typed instruction, this node's own data,
the global model) and returns a typed reply (fcl_flower/protocol). Which handler answers which
phase is said by the method's registry entry (fcl_flower/methods.py).
"""
