"""Mixture of experts: router, permutation, experts, token dispatchers, the overlapped layer.

Math (router, permute, experts) and communication (dispatcher) live in separate modules; the
layer composes them. Nothing here reads global state: groups, ledgers and switches are passed.
"""
from mpoverlap.moe.dispatcher import AllGatherDispatcher, AllToAllDispatcher
from mpoverlap.moe.experts import Experts, GroupedExperts
from mpoverlap.moe.layer import MoELayer, build_moe_layer, moe_kwargs
from mpoverlap.moe.permute import permute, unpermute
from mpoverlap.moe.router import RouterOutput, TopKRouter

__all__ = ["AllGatherDispatcher", "AllToAllDispatcher", "Experts", "GroupedExperts", "MoELayer", "build_moe_layer", "moe_kwargs",
           "permute", "unpermute", "RouterOutput", "TopKRouter"]
