"""The worker: holds stages of the pipeline and runs them for whatever sequences arrive.

``core`` decides (sans-IO: state, events in, commands out); ``shell`` carries the commands out
over the control channel, the data port (``dataport``), peer links (``links``) and the compute
thread (``runners``), all reached through ``ports``; ``settings`` is what it is started with.
The simulation runs the same shell on fake ports, with a fake model as its compute (``cluster.sim_worker``)."""

from .settings import WorkerSettings, reconnect_delay
from .shell import Worker

__all__ = ["Worker", "WorkerSettings", "reconnect_delay"]
