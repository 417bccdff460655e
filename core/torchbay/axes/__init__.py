"""The contracts a plugin subclasses, one module per axis: ``device`` (DeviceBackend), ``strategy`` (Strategy,
MemoryEstimate), ``precision`` (Precision), ``checkpoint_io`` (CheckpointIO), ``cluster`` (ClusterEnvironment).
Plugin authors import them from :mod:`torchbay.plugin`.
"""
