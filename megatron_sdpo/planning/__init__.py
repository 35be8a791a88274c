"""Planning a launch before anything loads: the launch plan, the memory ledger per phase, the census
of live tensors that checks it (`run --dry-run`)."""
