"""What a run is configured with, and what it may be configured with.

``attentions``: the table of every ``attention=<name>`` (family, status, options,
implementation); ``policy``: the pinned SSA training policy that resolves a name and its
options; ``check``: the launcher configuration checks. All pure Python (no torch /
megatron import), so launchers and config tests stay cheap.
"""
