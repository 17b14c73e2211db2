"""What a coordinator is configured with: ``CoordinatorSettings`` (``edgepipe serve`` fills it from
its flags; the simulation and the tests set their own). Read by the coordinator and lent, read
only, to its collaborators (``ports.Ports.settings``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CoordinatorSettings:
    min_workers: int = 1
    join_token: str | None = None
    heartbeat_s: float = 0.5
    dead_after_s: float = 2.0  # silence before a worker may be suspected (then probed; lost after lose_after_s)
    lose_after_s: float = 10.0  # a suspected worker is lost after this much silence (or 3x its longest gap)
    load_timeout_s: float = 120.0
    step_timeout_s: float = 60.0
    precision: str | None = None
    calibrate: bool = True  # time two unit ranges on each joining worker
    replan_every_s: float = 10.0  # periodic check for drift
    lane_wait_s: float = 0.005  # how long a micro-batch waits for a member that is late
    direct_steps: int = 8  # a plan's last stage may feed the next step itself this many decode steps (cluster.direct; 0: every token via the coordinator)
    capacity_wait_s: float = 30.0  # a request waits this long for workers that can hold the model, then fails
    issue_data_secrets: bool = True  # False: stages derive data-port secrets from the join token (net.auth)
    max_wait_s: float = 300.0  # a request without progress for this long fails (cluster down, pipeline failing)
    calibration_file: str | None = None  # calibrations kept here survive a coordinator restart
    batch_invariant: bool = False  # stages run graphs that give a sequence the same bits alone as batched (graphs.pad_lone_rows)
    speculative: bool = False  # stages run the verify form (graphs.verify_form): decode steps may carry drafted tokens
    replay_in_one_prefill: bool = False  # with the verify form: a lost sequence's KV is rebuilt by one prefill (serve --verify-form)
    prefix_cache_positions: int = 4096  # KV positions each stage may keep of cached prompt prefixes (0: no prefix cache)
    prefix_block: int = 32  # token ids per cached block (cluster.prefix)
    kv_checkpoint_tokens: int = 32  # copy a live sequence's KV to the spare plan every this many tokens (0: never; cluster.checkpoints)
    kv_checkpoint_in_flight: int = 2  # sequences whose checkpoint is being copied at once
    # bytes the weight variants beyond the package's own forms (a browser's fp32 units) may add to it on disk
    # (cluster.variants): one WebAssembly tab's worth, the 4 GiB its 32-bit memory can address
    variant_disk_bytes: int = 4 << 30
