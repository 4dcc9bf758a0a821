"""Deferred weight gradients (the W of zero-bubble pipelines).

Inside a deferring region (`WeightGradDeferral.deferring(queue)`, entered by the pipeline
executor around the backward of one (chunk, microbatch)), the backward of every linear the
project owns computes only its input gradient and queues a closure over (input, output
gradient) for its weight-gradient GEMM; `queue.run()` (the schedule's W action) computes them
and accumulates them into the parameters through autograd, so the gradient buffers and the
data-parallel hooks see them exactly as if the backward had produced them.

    deferral = WeightGradDeferral()
    attach_deferral(model_chunk, deferral)        # once, after the model is built
    queue = WeightGradQueue()
    with deferral.deferring(queue):
        torch.autograd.backward(out, grad)        # B: input gradients only
    queue.run()                                   # W

Models without an attached deferral run the original code paths, byte for byte.
"""
from mpoverlap.wgrad.deferral import WeightGradDeferral, WeightGradQueue
from mpoverlap.wgrad.functions import Embedding, Linear, attach_deferral, embedding, linear

__all__ = ["WeightGradDeferral", "WeightGradQueue", "Embedding", "Linear", "attach_deferral",
           "embedding", "linear"]
