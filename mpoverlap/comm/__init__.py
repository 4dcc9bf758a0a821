from mpoverlap.comm.collectives import all_gather, all_reduce, all_to_all, reduce_scatter, send_recv
from mpoverlap.comm.handle import MODES, CommHandle, wait_all
from mpoverlap.comm.ledger import CommLedger

__all__ = ["all_gather", "all_reduce", "all_to_all", "reduce_scatter", "send_recv", "MODES",
           "CommHandle", "wait_all", "CommLedger"]
