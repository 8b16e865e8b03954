"""dist_checks.py's fsdp check in a folder of its own, for the 2-rank launch of
checks that conftest.py shares: the 4-rank logits check's pipeline checkpoint
(copied into its ckpt/ first) loaded into the un-split model under FSDP2."""

from dist_checks import check_fsdp

#: For ranks.run_checks and shared_checks.py: this module's checks by name.
CHECKS = {"fsdp": check_fsdp}
