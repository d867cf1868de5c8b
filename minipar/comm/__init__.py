"""Communication: a Communicator over MPI point-to-point messages and the collectives built from them."""
from minipar.comm.communicator import CollectiveMismatch, Communicator, Handle, OpStats, start_watchdog

__all__ = ["CollectiveMismatch", "Communicator", "Handle", "OpStats", "start_watchdog"]
