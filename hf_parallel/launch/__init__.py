"""
Launching and leaving: the launcher's environment read in one place (`environment`), the guards that stop a
mislaunched run before its first step (`guards`), releasing DDP and the process group at exit (`teardown`), and the
one check of whole-number options (`validation`).

Nothing is imported here: `environment` and `validation` do not import torch, and the `hf-parallel` command imports
them without paying for it.
"""
