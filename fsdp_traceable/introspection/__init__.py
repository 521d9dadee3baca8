"""Tools that read what ``torch.compile`` made of a model: captured graphs
(:mod:`.capture`), collectives in FX graphs (:mod:`.graph`) and in Inductor's output
code (:mod:`.inductor_code`), compile records (:mod:`.compiles`), the calls Dynamo
inlines (:mod:`.inlined_calls`), and the
:func:`~.explain.explain` report. Import the modules you need; nothing here is
imported by ``import fsdp_traceable``."""
