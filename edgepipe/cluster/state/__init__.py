"""The cluster as data: ``ClusterState``, the events ``apply`` understands, and the books it keeps
(admission, steps, lanes, prefix blocks, checkpoints, workers, devices, measurements). Imports
nothing above it in the cluster."""
