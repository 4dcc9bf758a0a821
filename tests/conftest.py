"""Suite-wide settings: the strict communication ledger (see mpoverlap/comm/ledger.py) is on for
every test and for every worker a test starts (spawned and launched processes inherit the
environment), so any collective issued and never waited fails the test that issued it."""
import os

from mpoverlap.comm.ledger import STRICT_ENV

os.environ.setdefault(STRICT_ENV, "1")
