"""``python tests/helpers/faulty_train.py PHASE RANK -- TRAIN ARGS...``: ``python -m minipar train`` with one
fault injected on rank RANK only, in one phase of the job (used by tests/test_faults.py):

    startup           building the model, after the mesh's communicators exist
    step              the second training step's forward/backward
    evaluation        the first validation pass
    checkpoint-write  the disk fills up halfway through writing this rank's shard
    checkpoint-load   reading the checkpoint to resume from
"""
import errno
import sys

from mpi4py import MPI

import minipar.checkpoint
import minipar.train
from minipar.__main__ import main


def injected(*args, **kwargs):
    raise OSError(f"injected fault ({PHASE})")


def second_call_fails(fn):
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            injected()
        return fn(*args, **kwargs)
    return wrapper


def disk_fills_up(path, chunks):
    def first_chunk_then_full():
        yield chunks[0]
        raise OSError(errno.ENOSPC, f"No space left on device (injected fault, writing {path})")
    real_atomic_write(path, first_chunk_then_full())


PHASE, RANK = sys.argv[1], int(sys.argv[2])
real_atomic_write = minipar.checkpoint.atomic_write
if MPI.COMM_WORLD.Get_rank() == RANK:
    if PHASE == "startup":
        minipar.train.build_model = injected
    elif PHASE == "step":
        minipar.train.Pipeline.run = second_call_fails(minipar.train.Pipeline.run)
    elif PHASE == "evaluation":
        minipar.train.evaluate = injected
    elif PHASE == "checkpoint-write":
        minipar.checkpoint.atomic_write = disk_fills_up
    elif PHASE == "checkpoint-load":
        minipar.train.load_checkpoint = injected
    else:
        raise SystemExit(f"unknown phase {PHASE}")
sys.exit(main(["train", *sys.argv[sys.argv.index("--") + 1:]]))
