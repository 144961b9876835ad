"""lmlab's own parallelism, written to be read: NaiveDDP, BucketedDDP, ZeRO1, FSDP (ZeRO-3) and ExpertParallel, the
collective helpers they and `lmlab bench comm` use, and `run_processes` to start a multi-process job."""

from lmlab.parallel.bucketed_ddp import BucketedDDP
from lmlab.parallel.comm import (COLLECTIVES, CommResult, algorithm_bandwidth, broadcast_module, bus_bandwidth,
                                 bus_factor, time_collective)
from lmlab.parallel.expert_parallel import ExpertParallel
from lmlab.parallel.fsdp import FSDP
from lmlab.parallel.launch import RankFailedError, device_for, free_port, run_processes
from lmlab.parallel.naive_ddp import NaiveDDP
from lmlab.parallel.zero1 import ZeRO1, assign_owners, optimizer_state_numel

__all__ = ["BucketedDDP", "COLLECTIVES", "CommResult", "ExpertParallel", "FSDP", "NaiveDDP", "RankFailedError", "ZeRO1", "algorithm_bandwidth",
           "assign_owners", "broadcast_module", "bus_bandwidth", "bus_factor", "device_for", "free_port",
           "optimizer_state_numel", "run_processes", "time_collective"]
