"""The ``fsdp-traceable`` commands (``train``, ``bench``, ``demo``, ``explain``): run
with ``python -m fsdp_traceable <command>``; :mod:`.main` parses the arguments."""
