"""The patches of torch (``fsdp_traceable/_torch_patches/``), one test module per patch
module.

Per patch: what it changes, and a check that torch without it still has the problem,
named ``test_torch_still_...``. When one of those fails, torch fixed the problem on
the version under test: the patch can go there (see [Note: torch patches]).
"""
